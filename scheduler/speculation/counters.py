"""Server-wide speculation counters, per sequence and step: what was proposed and accepted (exported in /metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field

from proto import messages as m
from scheduler.speculation.acceptance import ServerAcceptance
from scheduler.speculation.cost import ProposeCostModel

_AVERAGE_WEIGHT = 0.05  # of each new sample in the moving averages of a proposal's cost: about the last 20 count


@dataclass
class SpecCounters:
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_verify_steps: int = 0
    num_plain_decode_steps: int = 0
    steps_by_k: dict[int, int] = field(default_factory=dict)  # per step sent to a target: the largest k chosen
    proposed_by_position: dict[int, int] = field(default_factory=dict)  # verify steps with a draft at position i
    accepted_by_position: dict[int, int] = field(default_factory=dict)  # of those, the ones that accepted it
    # What a proposal costs, as moving averages over the answers: the draft service's own time, and the wait from the
    # request's sending to its answer.
    num_proposals: int = 0
    propose_ms: float = 0.0
    propose_wait_ms: float = 0.0
    # What waiting for proposals costs a target, as moving averages over its steps: the time from a step's planning to
    # its result, less the step itself (idle_ms, over the steps that did not wait), and how much more that is in the
    # steps that did (ask_ms; besides the round trip, the events that send and answer it and what runs meanwhile).
    num_asked_steps: int = 0
    num_plain_steps: int = 0
    idle_ms: float = 0.0
    ask_ms: float = 0.0
    policy: str = ""  # --speculation-policy, shown with the counters
    acceptance: ServerAcceptance = field(default_factory=ServerAcceptance)  # per source and draft position
    propose_cost: ProposeCostModel = field(default_factory=ProposeCostModel)  # the wait, by the longest proposal asked

    def proposed(self, duration_ms: float, waited_ms: float) -> None:
        if not (duration_ms >= 0.0 and waited_ms >= 0.0):  # NaN or negative: a clock that cannot be believed
            return
        weight = _weight(self.num_proposals)
        self.propose_ms += weight * (duration_ms - self.propose_ms)
        self.propose_wait_ms += weight * (waited_ms - self.propose_wait_ms)
        self.num_proposals += 1

    def stepped(self, idle_ms: float, asked: tuple[int, int] | None, waited_ms: float = 0.0) -> None:
        """A target's step came back `idle_ms` after it was planned, less its own time; `asked`: it waited `waited_ms`
        for proposals of (the largest k, the sequences) asked for. What the wait cost is what this was beyond a plain
        step's, and no less than the wait itself
        (plain steps include prefills, whose events take longer), and it is what
        the policy prices an ask at (the round trip alone leaves out the events on either side of it)."""
        if not idle_ms == idle_ms:  # NaN: a clock that cannot be believed (below 0, the step's own clock ran ahead)
            return
        if asked is None:
            self.idle_ms += _weight(self.num_plain_steps) * (idle_ms - self.idle_ms)
            self.num_plain_steps += 1
            return
        cost_ms = max(0.0, waited_ms, idle_ms - self.idle_ms)
        self.propose_cost.observe(*asked, cost_ms)
        self.ask_ms += _weight(self.num_asked_steps) * (cost_ms - self.ask_ms)
        self.num_asked_steps += 1

    def decide(self, k: int) -> None:
        self.steps_by_k[k] = self.steps_by_k.get(k, 0) + 1

    def record(
        self,
        num_draft_tokens: int,
        num_accepted: int,
        depth: int = 0,
        source: str = "",
        accepted_nodes: list[int] | None = None,
    ) -> None:
        """A decode step of one sequence: its draft tokens (a tree's `depth` positions deep, `accepted_nodes` its
        accepted branch; a chain's as many as its tokens) from `source`, and how many it accepted, each at the next
        position."""
        if num_draft_tokens:
            self.acceptance.observe(source, depth or num_draft_tokens, num_draft_tokens, num_accepted)
            if accepted_nodes is not None:
                self.acceptance.observe_tree(source, num_draft_tokens, accepted_nodes)
            self.num_draft_tokens += num_draft_tokens
            self.num_accepted_draft_tokens += num_accepted
            self.num_verify_steps += 1
            for position in range(depth or num_draft_tokens):
                self.proposed_by_position[position] = self.proposed_by_position.get(position, 0) + 1
            for position in range(num_accepted):
                self.accepted_by_position[position] = self.accepted_by_position.get(position, 0) + 1
        else:
            self.num_plain_decode_steps += 1

    def info(self) -> m.SpeculationInfo:
        return m.SpeculationInfo(
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_draft_tokens=self.num_accepted_draft_tokens,
            num_verify_steps=self.num_verify_steps,
            num_plain_decode_steps=self.num_plain_decode_steps,
            acceptance_rate=self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            mean_accepted_length=self.num_accepted_draft_tokens / self.num_verify_steps
            if self.num_verify_steps
            else 0.0,
            steps_by_k=dict(self.steps_by_k),
            proposed_by_position=dict(self.proposed_by_position),
            accepted_by_position=dict(self.accepted_by_position),
            propose_ms=round(self.propose_ms, 3),
            propose_wait_ms=round(self.propose_wait_ms, 3),
            ask_ms=round(self.ask_ms, 3),
            sources=self.acceptance.info(m.MAX_DRAFT_TOKENS),
            policy=self.policy,
        )


def _weight(num_before: int) -> float:
    """Of a new sample in a moving average of `num_before` samples: the first ones count in full."""
    return max(_AVERAGE_WEIGHT, 1 / (num_before + 1))
