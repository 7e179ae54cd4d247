"""How often drafts are accepted, learned from verify steps: the gain side of the speculation decision.

For each draft position i (a chain's i-th token; a tree's depth i below the sequence's last
token) the rate is how often a token there was accepted given that the tokens before it
were: accepted[i] / reached[i], where a verify step *reached* position i when it proposed
something there and accepted everything before it. A proposal of k positions then brings

    E(k) = sum over j < k of (rate[0] * ... * rate[j])

accepted tokens, besides the one token every step makes.

Rates are kept per proposer source ("lookup", "phrases", "head", "model", as the draft
service names its proposals) for the whole server, and per request: a request starts at the
server's rates for the source, worth PRIOR_STEPS verify steps of its own, then follows its
own steps. Neither fades while nothing is verified: a record fading back toward the
server's rates (or the server's toward 1/2) made every request that stopped speculating look
worth asking again after a dozen steps, a retry nobody paid for.

Which source will answer is known only when the answer comes, so before a step each request
has an outlook (`RequestAcceptance.outlook`): per source, the chance it answers (how often
the draft found anything for the request, and which sources answered it lately) and what
its drafts bring.

A proposer that says how likely each of its drafts is has those chances held to what the
target accepted, per source, server-wide and per request alike (chances.py).

Every rate and chance is read at its mean. An optimistic reading (the mean plus half a
standard error) was how a request got tried again, and it cost: multiplied down a chain it
promised 2.4 tokens where the means promised 1.4 (six positions at 0.6 from two steps), and
on two cores, where an ask costs a float32 step a quarter of its time, free chat with the
default draft ran at 0.92x. Trying is now the policy's, apart and bounded (policy.py
`ExploreBudget`); `unasked_steps` says how long a request has gone without.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from proto import messages as m
from scheduler.speculation.chances import CHANCE_PRIOR, ChanceRecord

FORGET_SERVER = 0.995  # per verify step of a source: about its last 200 count server-wide
FORGET_REQUEST = 0.9  # per verify step of a request: about its last 10 count
PRIOR_STEPS = 1.0  # what the server's rates weigh in a request's, in verify steps
ANY = ""  # the record over all sources (what the plan, made before the proposal, reads)
GRAMMAR = "grammar"  # tokens a request's grammar forces: always accepted, counted apart, never in ANY


@dataclass
class PositionRates:
    """Weighted counts per draft position: steps that reached it, and of those, steps that accepted its token."""

    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def observe(self, depth: int, num_accepted: int, forget: float) -> None:
        """A verify step that proposed `depth` positions and accepted the first `num_accepted`."""
        self.scale(forget)
        while len(self.reached) < depth:
            self.reached.append(0.0)
            self.accepted.append(0.0)
        for position in range(min(depth, num_accepted + 1)):
            self.reached[position] += 1.0
            if position < num_accepted:
                self.accepted[position] += 1.0

    def scale(self, factor: float) -> None:
        self.reached = [value * factor for value in self.reached]
        self.accepted = [value * factor for value in self.accepted]

    def weight(self, position: int) -> float:
        return self.reached[position] if position < len(self.reached) else 0.0

    def mean(self, position: int, prior: float, prior_weight: float) -> float:
        """The rate at `position`: its own counts, with `prior_weight` steps at the `prior` rate."""
        reached = self.weight(position)
        accepted = self.accepted[position] if position < len(self.accepted) else 0.0
        return (accepted + prior_weight * prior) / (reached + prior_weight)


def expected_accepted(rates: list[float]) -> list[float]:
    """E(k) for k = 0 .. len(rates): the tokens a proposal of k positions brings, given each position's rate."""
    expected = [0.0]
    chance = 1.0
    for rate in rates:
        chance *= rate
        expected.append(expected[-1] + chance)
    return expected


class ServerAcceptance:
    """Every source's rates server-wide (the start of each request's), and the counts shown in GetServerInfo."""

    def __init__(self) -> None:
        self.by_source: dict[str, PositionRates] = {ANY: PositionRates()}
        # A token tree's nodes, per source: how often node i (in the order proposed) was on the accepted branch, of the
        # trees that had an i-th node (its `reached` counts those trees, its `accepted` those that accepted it).
        self.by_node: dict[str, PositionRates] = {}
        self.num_verify_steps: dict[str, int] = {}
        self.num_draft_tokens: dict[str, int] = {}
        self.num_accepted: dict[str, int] = {}
        self.found = (
            PositionRates()
        )  # of the sequences the draft service was asked for, those it proposed something for
        self.answered_by: dict[str, float] = {}  # of its proposals, the share each source made (weighted counts)
        self.chances: dict[str, ChanceRecord] = {}  # per source that gives its drafts' chances
        self._rates: dict[tuple[str, int], float] = {}  # rate(), as read since the last change (each step reads many)

    def asked(self, source: str | None) -> None:
        """The draft service answered for a sequence: with a proposal from `source`, or with nothing (None: no lookup
        matched)."""
        self.found.observe(1, int(source is not None), FORGET_SERVER)
        if source is not None:
            _count(self.answered_by, source, FORGET_SERVER)
        self._rates.clear()

    def found_rate(self) -> float:
        return self.found.mean(0, 0.5, 1.0)

    def observe(self, source: str, depth: int, num_drafts: int, num_accepted: int) -> None:
        source = _known(source)
        for key in {source} if source == GRAMMAR else {source, ANY}:
            self.by_source.setdefault(key, PositionRates()).observe(depth, num_accepted, FORGET_SERVER)
        self._rates.clear()
        self.num_verify_steps[source] = self.num_verify_steps.get(source, 0) + 1
        self.num_draft_tokens[source] = self.num_draft_tokens.get(source, 0) + num_drafts
        self.num_accepted[source] = self.num_accepted.get(source, 0) + num_accepted

    def observe_chances(self, source: str, predicted: float, num_accepted: int) -> None:
        """A verified proposal whose drafts' chances summed to `predicted`: `num_accepted` of them were accepted."""
        self.chances.setdefault(_known(source), ChanceRecord()).observe(predicted, num_accepted, FORGET_SERVER)

    def chance_scale(self, source: str) -> float:
        record = self.chances.get(_known(source))
        return record.scale(1.0, CHANCE_PRIOR) if record is not None else 1.0

    def info(self, max_positions: int) -> dict[str, m.SourceAcceptance]:
        return {
            source: m.SourceAcceptance(
                num_verify_steps=count,
                num_draft_tokens=self.num_draft_tokens[source],
                num_accepted_draft_tokens=self.num_accepted[source],
                recent_rates=[
                    round(self.by_source[source].mean(i, 0.0, 0.0), 4)
                    for i in range(min(max_positions, len(self.by_source[source].reached)))
                    if self.by_source[source].weight(i) > 0.0
                ],
            )
            for source, count in sorted(self.num_verify_steps.items())
        }

    def observe_tree(self, source: str, num_nodes: int, accepted_nodes: list[int]) -> None:
        """A token tree of `num_nodes` nodes whose branch `accepted_nodes` was accepted."""
        source = _known(source)
        rates = self.by_node.setdefault(source, PositionRates())
        rates.scale(FORGET_SERVER)
        self._rates.clear()
        while len(rates.reached) < num_nodes:
            rates.reached.append(0.0)
            rates.accepted.append(0.0)
        on_branch = set(accepted_nodes)
        for node in range(num_nodes):
            rates.reached[node] += 1.0
            if node in on_branch:
                rates.accepted[node] += 1.0

    def node_chances(self, source: str, num_nodes: int) -> list[float]:
        """How likely each of a tree's first `num_nodes` nodes is to be accepted, from `source`'s recent trees (a node
        index no tree had yet: as likely as the first node's depth allows, halved at each step down)."""
        rates = self.by_node.get(source) or PositionRates()
        first = self.rate(source, 0)
        return [rates.mean(node, first / 2**node, 1.0) for node in range(num_nodes)]

    def rate(self, source: str, position: int) -> float:
        """The server's rate at `position` for `source` (1/2 for a source it has not seen: another source's record says
        nothing about it; at a position no step reached, the one before's)."""
        if (known := self._rates.get((source, position))) is not None:
            return known
        rates = self.by_source.get(source)
        if rates is None or rates.weight(0) == 0.0:  # a source not seen yet: as uncertain as any rate can be
            rate = 0.5
        elif rates.weight(position) == 0.0:
            rate = self.rate(source, position - 1)
        else:
            rate = rates.mean(position, 0.5, 1.0)
        self._rates[(source, position)] = rate
        return rate

    def rates(self, source: str, num_positions: int) -> list[float]:
        return [self.rate(source, position) for position in range(num_positions)]


@dataclass
class RequestAcceptance:
    """One request's rates per source (and over all of them, ANY)."""

    by_source: dict[str, PositionRates] = field(default_factory=dict)
    found: PositionRates = field(default_factory=PositionRates)  # of its proposals asked for, those that came non-empty
    answered_by: dict[str, float] = field(default_factory=dict)  # of its proposals, the share each source made
    unasked_steps: float = math.inf  # its decode steps since the draft service last answered for it (inf: never)
    exploring: bool = False  # asked for in this step though its estimates did not call for it (policy.py `explored`)
    chances: dict[str, ChanceRecord] = field(default_factory=dict)  # per source that gives its drafts' chances

    def asked(self, source: str | None) -> None:
        self.unasked_steps = 0.0
        self.found.observe(1, int(source is not None), FORGET_REQUEST)
        if source is not None:
            _count(self.answered_by, source, FORGET_REQUEST)

    def outlook(self, num_positions: int, server: ServerAcceptance) -> list[tuple[float, list[float]]]:
        """What asking the draft service for up to `num_positions` tokens may bring it: per source that may answer,
        the chance it does, and the tokens its first k drafts (nodes of a tree) are expected to bring, k = 0 ..
        num_positions. The chances sum to the chance the draft finds anything; which source answers is not known
        when the step is planned (prompt lookup matches or it does not), and each answer is cut to what pays."""
        found = self.found.mean(0, server.found_rate(), PRIOR_STEPS)
        own = sum(self.answered_by.values())
        theirs = sum(server.answered_by.values())
        shares = (
            {
                source: (self.answered_by.get(source, 0.0) + PRIOR_STEPS * count / theirs) / (own + PRIOR_STEPS)
                for source, count in server.answered_by.items()
            }
            if theirs
            else {ANY: 1.0}
        )
        outlook = []
        for source, share in shares.items():
            if source in server.by_node:  # it proposes trees
                gains = self.tree_gains(source, num_positions, server)
            else:
                gains = expected_accepted(self.rates(source, num_positions, server))
            outlook.append((found * share, gains))
        return outlook

    def observe(self, source: str, depth: int, num_accepted: int) -> None:
        for key in {source, ANY}:
            self.by_source.setdefault(key, PositionRates()).observe(depth, num_accepted, FORGET_REQUEST)

    def observe_chances(self, source: str, predicted: float, num_accepted: int) -> None:
        self.chances.setdefault(_known(source), ChanceRecord()).observe(predicted, num_accepted, FORGET_REQUEST)

    def chance_scale(self, source: str, server: ServerAcceptance) -> float:
        """What `source`'s chances for this request's drafts are to be multiplied by: its own record, starting from
        the server's."""
        record = self.chances.get(_known(source)) or ChanceRecord()
        return record.scale(server.chance_scale(source), PRIOR_STEPS)

    def plain_step(self) -> None:
        """A decode step that verified no draft of it."""
        self.unasked_steps += 1

    def tree_gains(self, source: str, num_nodes: int, server: ServerAcceptance) -> list[float]:
        """The tokens a tree from `source` is expected to bring with its first n nodes, n = 0 .. num_nodes: the sum of
        their chances server-wide, scaled by how this request's first draft token fares against the server's."""
        scale = self.rates(source, 1, server)[0] / max(server.rate(source, 0), 1e-3)
        gains = [0.0]
        for chance in server.node_chances(source, num_nodes):
            gains.append(gains[-1] + min(1.0, chance * scale))
        return gains

    def rates(self, source: str, num_positions: int, server: ServerAcceptance) -> list[float]:
        """The rate at each of the first `num_positions` positions, for drafts from `source` (ANY: from whichever source
        serves it next)."""
        own = self.by_source.get(source) or PositionRates()
        return [own.mean(position, server.rate(source, position), PRIOR_STEPS) for position in range(num_positions)]


def _known(source: str) -> str:
    """A draft service's word for its source, kept among a few names however many it says ("other" for the rest)."""
    return source if source in m.PROPOSAL_SOURCES else "other"


def _count(counts: dict[str, float], source: str, forget: float) -> None:
    """One more for `source`, every count before it weighing `forget` times less."""
    source = _known(source)
    for key in counts:
        counts[key] *= forget
    counts[source] = counts.get(source, 0.0) + 1.0
