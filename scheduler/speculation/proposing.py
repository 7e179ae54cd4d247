"""The propose requests sent to the draft service: each one built, kept until it is answered (or given up on, when a
late answer still tells what the service holds), and its answer checked; and what a step carries of a proposal."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.draft_rules import drafts_problem
from proto import messages as m
from scheduler.batching import StepPlan
from scheduler.requests import Request
from scheduler.request_table import RequestTable
from scheduler.speculation.counters import SpecCounters
from scheduler.speculation.state import SpecStates
from scheduler.workers import WorkerRecord

_ABANDONED_TIMEOUTS = 10  # a timed-out proposal's late answer is still awaited for this many propose timeouts


@dataclass(frozen=True)
class PendingProposal:
    """A target worker's planned step, waiting for the draft service's proposals."""

    propose_id: int
    worker_id: str
    worker_incarnation: int
    plan: StepPlan
    sent_at_s: float


def proposal_problem(proposal: m.Proposal, num_tokens: int, vocab_size: int, sequence_len: int) -> str:
    """Why a proposal cannot be verified ("" when it can): a bad draft must never reach a target."""
    if not 0 <= proposal.num_held <= sequence_len:
        return f"num_held {proposal.num_held} for a sequence of {sequence_len} tokens"
    if len(proposal.token_ids) > num_tokens:
        return f"{len(proposal.token_ids)} tokens proposed, {num_tokens} asked for"
    if proposal.chances is not None:
        if len(proposal.chances) != len(proposal.token_ids):
            return f"{len(proposal.chances)} chances for {len(proposal.token_ids)} draft tokens"
        if not all(0.0 <= chance <= 1.0 for chance in proposal.chances):
            return "a draft's chance outside 0..1"
    return drafts_problem(proposal.token_ids, proposal.parents, proposal.dists, vocab_size)


class ProposeRequests:
    """The propose requests not answered yet, and those given up on whose answer may still come."""

    def __init__(self, propose_timeout_s: float, states: SpecStates, counters: SpecCounters) -> None:
        self._propose_timeout_s = propose_timeout_s
        self._states = states
        self._counters = counters
        self._pending: dict[int, PendingProposal] = {}  # propose requests the draft service has not answered
        self._abandoned: dict[int, PendingProposal] = {}  # timed out; a late answer still updates the draft views
        self._next_propose_id = 0

    def propose(self, draft: WorkerRecord, target: WorkerRecord, plan: StepPlan, now_s: float) -> m.ProposeRequest:
        """The propose request for `target`'s planned step, which now waits for its answer."""
        self._next_propose_id += 1
        seqs = []
        for item in plan.seqs:
            r = item.request
            if r.request_id not in plan.num_draft_tokens:
                continue
            state = self._states.of(r.request_id)
            view = state.draft
            view.known = True
            features = None
            if draft.hello.feature_width:
                features = state.features.rows_from(view.num_features, r.num_tokens - 1)
                view.num_features = r.num_tokens - 1
            seqs.append(
                m.ProposeSeq(
                    request_id=r.request_id,
                    num_held=view.num_held,
                    num_drop=view.num_proposed,
                    new_token_ids=r.token_slice(view.num_stable, r.num_tokens),
                    num_tokens=plan.num_draft_tokens[r.request_id],
                    sampling=r.sampling,
                    features=features,
                    tenant=r.tenant,
                )
            )
        pending = PendingProposal(self._next_propose_id, target.worker_id, target.incarnation, plan, now_s)
        self._pending[pending.propose_id] = pending
        target.awaiting_proposal = pending.propose_id
        return m.ProposeRequest(pending.propose_id, draft.incarnation, seqs)

    def answer(
        self,
        result: m.ProposeResult,
        requests: RequestTable,
        vocab_size: int,
        report: Callable[[str], None],
        now_s: float,
    ) -> tuple[PendingProposal, dict[str, m.Proposal]] | None:
        """The pending request answered and its usable proposals; None for an answer nobody waits for.

        Every proposal updates what the request's draft view says the service holds; one
        that cannot be verified is reported and dropped.
        """
        pending = self._pending.pop(result.propose_id, None) or self._abandoned.pop(result.propose_id, None)
        if pending is None:
            return None
        self._counters.proposed(result.duration_ms, (now_s - pending.sent_at_s) * 1000)
        asked = pending.plan.num_draft_tokens
        proposals: dict[str, m.Proposal] = {}
        for proposal in result.proposals:
            request = requests.get(proposal.request_id)
            if request is None or proposal.request_id not in asked:
                continue
            state = self._states.of(request.request_id)
            problem = proposal_problem(proposal, asked[proposal.request_id], vocab_size, request.num_tokens)
            if problem:
                report(problem)
                state.draft.reset()
                continue
            # Whatever happens to the step, the draft service now holds this.
            state.draft.num_stable, state.draft.num_proposed = proposal.num_held, len(proposal.token_ids)
            state.acceptance.asked(proposal.source if proposal.token_ids else None)
            self._counters.acceptance.asked(proposal.source if proposal.token_ids else None)
            if proposal.num_held == 0:  # it started the sequence over: it holds no features either
                state.draft.num_features = 0
            if proposal.token_ids:
                proposals[proposal.request_id] = proposal
        return pending, proposals

    def pending(self, propose_id: int) -> PendingProposal | None:
        """The unanswered propose request of that id, if any."""
        return self._pending.get(propose_id)

    def timed_out(self, now_s: float) -> list[PendingProposal]:
        """Pending requests past the propose timeout (to give up on); forgets abandoned ones too old to be answered."""
        too_old = _ABANDONED_TIMEOUTS * self._propose_timeout_s
        for pending in [p for p in self._abandoned.values() if now_s - p.sent_at_s > too_old]:
            del self._abandoned[pending.propose_id]  # no answer will come now; the views were reset at the timeout
        return [p for p in self._pending.values() if now_s - p.sent_at_s > self._propose_timeout_s]

    def give_up(self, pending: PendingProposal, requests: RequestTable, *, answer_may_come: bool) -> None:
        """What the draft holds for these requests is unknown until its answer comes, if it does."""
        self._pending.pop(pending.propose_id, None)
        if answer_may_come:
            self._abandoned[pending.propose_id] = pending
        for request_id in pending.plan.num_draft_tokens:
            if requests.get(request_id) is not None:
                self._states.of(request_id).draft.reset()

    def lost(self) -> list[PendingProposal]:
        """The draft service they went to is gone: no answer will come; the pending requests are the ones to give up."""
        self._abandoned.clear()
        return list(self._pending.values())


# What a step carries of a proposal: its tokens, their distributions, its tree.
DraftWork = tuple[list[int], list[m.SparseDist] | None, list[int] | None]


def draft_work(request: Request, proposal: m.Proposal | None) -> DraftWork:
    """What a step carries of a proposal: its tokens, their distributions (only where the request samples), its tree."""
    if proposal is None:
        return [], None, None
    dists = None if request.sampling.is_greedy else proposal.dists
    return proposal.token_ids, dists, proposal.parents  # a tree is of point masses (checked on arrival)
