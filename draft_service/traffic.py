"""Drafts from the text the server served (draft_service/suffix_store.py), scoped by tenant and held to what the
target accepted of them.

`--suffix-scope` says whose text may draft for a request: `tenant` (the default) the requests of
its own tenant (its API key, else its `user`, else the one tenant of callers nothing tells
apart), `global` every request's, `request` none but its own (prompt lookup's, which runs
before the store: the store is then not kept). Output is the target's either way; what another
tenant's text changes is how fast a request runs, and so a caller who can time its requests could
learn whether another tenant wrote a given text. `tenant` closes that between tenants.

What the target wrote calibrates the store's drafts: per tenant, the store's chance for each
token of its likeliest branch (given the tokens before it) against whether the target wrote it,
as moving averages, read once the sequence has moved past them, whether the drafts were
verified or not; their ratio scales every such chance the store gives that tenant. Reading
the text rather than the verdicts keeps a deep draft that the scheduler never verified from
staying as doubted as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from draft_service.suffix_store import SuffixStore, guesses

SuffixScope = Literal["tenant", "global", "request"]  # the choices of --suffix-scope (common/settings/choices.py)
_AVERAGE = 0.1  # weight of the newest outcome in the moving averages
_SCALE_RANGE = (0.2, 2.0)  # how far calibration may move a token's chance
_MAX_CALIBRATIONS = 4096  # tenants calibrated at once (the least recently drafted for forgotten first)


@dataclass
class _Calibration:
    predicted: float = 0.5  # moving average of the chance given to a token of the likeliest branch (after the ones
    observed: float = 0.5  # before it): moving average of whether the target wrote it

    @property
    def scale(self) -> float:
        low, high = _SCALE_RANGE
        return min(high, max(low, self.observed / self.predicted)) if self.predicted > 0 else 1.0


@dataclass(frozen=True)
class _Offer:
    tenant: str
    position: int  # where the sequence ended when the store drafted for it
    branch: list[int]  # the store's likeliest branch
    chances: list[float]  # each of its tokens' chance given the ones before it, before calibration


class TrafficDrafts:
    """The suffix store behind a proposer: what it records, what it offers a request, and how that was received."""

    def __init__(self, capacity_tokens: int, vocab_size: int, scope: SuffixScope) -> None:
        self.scope = scope
        keeps = scope != "request" and capacity_tokens > 0
        self._store = SuffixStore(capacity_tokens, vocab_size) if keeps else None
        self._calibrations: dict[str, _Calibration] = {}
        self._offers: dict[str, _Offer] = {}  # by request: the store's last draft, until the next one is asked

    @property
    def keeps_text(self) -> bool:
        """Whether it keeps served text at all (not under --suffix-scope request, nor with no room)."""
        return self._store is not None

    @property
    def num_tokens(self) -> int:
        return self._store.num_tokens if self._store is not None else 0

    def _tenant(self, tenant: str) -> str:
        return "" if self.scope == "global" else tenant

    def record(self, tenant: str, token_ids: list[int]) -> None:
        """Text the server read or wrote for `tenant` (a prompt as it came, a completion as it finished)."""
        if self._store is not None:
            self._store.add(self._tenant(tenant), token_ids)

    def chances(
        self, request_id: str, tenant: str, tokens: list[int], k: int, min_chance: float
    ) -> dict[tuple[int, ...], float]:
        """The store's branches for a sequence of `tenant`'s, each with its calibrated chance (none: {})."""
        self._settle(request_id, tokens)
        if self._store is None:
            return {}
        owner = self._tenant(tenant)
        found = self._store.match(owner, tokens, k)
        if found is None:
            return {}
        calibration = self._calibrations.pop(owner, None) or _Calibration()
        self._calibrations[owner] = calibration  # the most recent last
        if len(self._calibrations) > _MAX_CALIBRATIONS:
            del self._calibrations[next(iter(self._calibrations))]
        chances = guesses(found, k, calibration.scale, min_chance)
        branch, given = _likeliest_branch(chances)
        if branch:
            self._offers[request_id] = _Offer(
                owner, len(tokens), branch, [chance / calibration.scale for chance in given]
            )
        return chances

    def forget(self, request_id: str) -> None:
        self._offers.pop(request_id, None)

    def _settle(self, request_id: str, tokens: list[int]) -> None:
        """The outcome of the store's last draft for this request: each of its tokens the sequence has moved past, up to
        the first the target did not write."""
        offer = self._offers.get(request_id)
        if offer is None or len(tokens) <= offer.position:
            return
        del self._offers[request_id]
        calibration = self._calibrations.get(offer.tenant)
        if calibration is None:
            return
        written = tokens[offer.position : offer.position + len(offer.branch)]
        for token, drafted, chance in zip(written, offer.branch, offer.chances):
            calibration.predicted += _AVERAGE * (chance - calibration.predicted)
            calibration.observed += _AVERAGE * ((token == drafted) - calibration.observed)
            if token != drafted:
                break


def _likeliest_branch(chances: dict[tuple[int, ...], float]) -> tuple[list[int], list[float]]:
    """The branch that takes the likeliest child at each depth, and each of its tokens' chance given the ones before."""
    branch: tuple[int, ...] = ()
    given: list[float] = []
    while True:
        children = [
            (chance, child)
            for child, chance in chances.items()
            if child[:-1] == branch and len(child) == len(branch) + 1
        ]
        if not children:
            return list(branch), given
        chance, branch = max(children)
        given.append(chance / (chances[branch[:-1]] if branch[:-1] else 1.0))
