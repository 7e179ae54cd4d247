"""What a proposer says of its own drafts, held to what the target accepted of them.

A proposer may give each draft the chance that the target accepts it (`m.Proposal.chances`:
the suffix store and the phrases score every node of their trees by how long the match
behind it runs and how often what followed it agreed). Those chances are held to the target's
verdicts per source: the drafts accepted over the sum of the verified drafts' chances, server-wide
and then per request, as the rates of acceptance.py are. A proposal that carries chances is
sized by them (goodput.py `trimmed`). Unlike a rate per draft position, they say which drafts of
this proposal are sure: a deep position that failed once for a short match does not keep
later proposals, from long matches, from reaching it.
"""

from __future__ import annotations

from dataclasses import dataclass

CHANCE_PRIOR = 2.0  # what a proposer's own chances weigh before its drafts are verified, in accepted drafts


@dataclass
class ChanceRecord:
    """A proposer's chances against the target: drafts accepted and the sum of the chances of those verified."""

    accepted: float = 0.0
    predicted: float = 0.0

    def observe(self, predicted: float, accepted: int, forget: float) -> None:
        self.accepted = self.accepted * forget + accepted
        self.predicted = self.predicted * forget + predicted

    def scale(self, prior: float, prior_weight: float) -> float:
        """What the proposer's chances are to be multiplied by: accepted over predicted, with `prior_weight` drafts at
        the `prior` scale."""
        return (self.accepted + prior_weight * prior) / (self.predicted + prior_weight)


def chance_gains(chances: list[float], scale: float) -> list[float]:
    """The tokens a proposal's first n drafts bring, n = 0 .. len(chances), each draft's chance times `scale` (a tree's
    nodes too: the accepted drafts' count is the sum of each node's chance of being on the accepted branch)."""
    gains = [0.0]
    for chance in chances:
        gains.append(gains[-1] + min(1.0, chance * scale))
    return gains
