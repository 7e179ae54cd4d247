"""What the scheduler believes the draft service holds for one request (its draft view)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class DraftView:
    """The draft service holds `num_stable` of the request's tokens, then its last proposal.

    The next propose request drops the `num_proposed` tokens that are not (yet) part of
    the sequence and appends the sequence from `num_stable` on.
    """

    num_stable: int = 0
    num_proposed: int = 0
    num_features: int = 0  # target feature rows it holds (positions 0 .. num_features-1), for a draft that reads them
    known: bool = False  # the draft service was ever told about it (so it must be told to forget it)
    generation: int = 0  # bumped by reset(): a verify result for an older generation must not move the counts

    @property
    def num_held(self) -> int:
        return self.num_stable + self.num_proposed

    def accept(self, num_accepted: int) -> None:
        """The first num_accepted proposed tokens became part of the sequence."""
        self.num_stable += num_accepted
        self.num_proposed -= num_accepted

    def reset(self) -> None:
        """The draft service's state is unknown (timeout) or gone (new incarnation)."""
        self.num_stable = self.num_proposed = self.num_features = 0
        self.generation += 1

    def forget(self) -> None:
        """Another draft service (or incarnation) serves now: it holds nothing of this request."""
        self.reset()
        self.known = False


def forget_views(views: Iterable[DraftView]) -> None:
    for view in views:
        view.forget()
