"""The scheduler's link to the draft service, part of the functional core (no I/O).

It knows which draft service proposals go to, the propose requests it has not answered
(and those given up on whose late answer still tells what the service holds), which
finished requests the service must forget, and whether steps must return target
features. The core asks it for a ProposeRequest before a speculative step and hands it
the answer; sending the step, with the proposals or without, stays the core's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from proto import messages as m
from scheduler.batching import ScheduledSeq
from scheduler.registry import WorkerRecord
from scheduler.request import Request
from scheduler.speculation import PendingProposal, proposal_problem

# A timed-out proposal's late answer is still awaited for this many propose timeouts.
_ABANDONED_TIMEOUTS = 10


class DraftLink:
    def __init__(self, propose_timeout_s: float) -> None:
        self._propose_timeout_s = propose_timeout_s
        self._pending: dict[int, PendingProposal] = {}  # propose requests the draft service has not answered
        self._abandoned: dict[int, PendingProposal] = {}  # timed out; a late answer still updates the draft views
        self._next_propose_id = 0
        self._forget: list[str] = []  # finished requests the draft service must forget, sent once per event
        self._in_use: tuple[str, int] | None = None  # (worker_id, incarnation) the requests' draft views describe
        # A draft that reads target features has said hello (and was not refused): every step returns them.
        self.features_wanted = False

    def current(self, workers: dict[str, WorkerRecord], requests: Iterable[Request]) -> WorkerRecord | None:
        """The draft service proposals go to: the one in use while it is READY, else the first READY one."""
        in_use = self._in_use
        current = workers.get(in_use[0]) if in_use else None
        if current is not None and in_use is not None and current.incarnation == in_use[1] and current.is_ready:
            return current
        draft = next((w for w in workers.values() if w.is_ready and not w.is_target), None)
        if draft is not None:
            forget_views(requests)  # what another draft (incarnation) held says nothing about this one
            self._in_use = (draft.worker_id, draft.incarnation)
        return draft

    def note_hello(self, draft: WorkerRecord) -> None:
        """From the first hello of a draft that reads target features on, every step returns them.

        Kept on when that draft goes away: a restarted draft then finds every running
        request's features complete, where a gap would cost the request speculation for good.
        """
        if draft.hello.feature_width > 0:
            self.features_wanted = True

    @staticmethod
    def with_features(draft: WorkerRecord, num_tokens: dict[str, int], requests: dict[str, Request]) -> dict[str, int]:
        """For a draft that reads target features, only the sequences whose every feature is at hand."""
        if not draft.hello.feature_width:
            return num_tokens
        for request_id in num_tokens:
            request = requests[request_id]
            if request.draft.num_features > request.features.count:
                request.draft.reset()  # it holds rows that were recomputed or lost here since: it starts over
        # Every position but the last has its feature.
        return {rid: k for rid, k in num_tokens.items() if requests[rid].features.count >= requests[rid].num_tokens - 1}

    def propose(self, draft: WorkerRecord, worker: WorkerRecord, plan: list[ScheduledSeq], num_tokens: dict[str, int],
                now_s: float) -> m.ProposeRequest:
        """The propose request for `worker`'s planned step, which now waits for its answer."""
        self._next_propose_id += 1
        seqs = []
        for item in plan:
            r = item.request
            if r.request_id not in num_tokens:
                continue
            view = r.draft
            view.known = True
            features = None
            if draft.hello.feature_width:
                features = r.features.rows_from(view.num_features, r.num_tokens - 1)
                view.num_features = r.num_tokens - 1
            seqs.append(m.ProposeSeq(
                request_id=r.request_id, num_held=view.num_held, num_drop=view.num_proposed,
                new_token_ids=r.token_slice(view.num_stable, r.num_tokens), num_tokens=num_tokens[r.request_id],
                sampling=r.sampling, features=features,
            ))
        pending = PendingProposal(self._next_propose_id, worker.worker_id, worker.incarnation, plan, num_tokens, now_s)
        self._pending[pending.propose_id] = pending
        worker.awaiting_proposal = pending.propose_id
        return m.ProposeRequest(pending.propose_id, draft.incarnation, seqs)

    def answer(self, result: m.ProposeResult, requests: dict[str, Request], vocab_size: int,
               report: Callable[[str], None]) -> tuple[PendingProposal, dict[str, m.Proposal]] | None:
        """The pending request answered and its usable proposals; None for an answer nobody waits for.

        Every proposal updates what the request's draft view says the service holds; one
        that cannot be verified is reported and dropped.
        """
        pending = self._pending.pop(result.propose_id, None) or self._abandoned.pop(result.propose_id, None)
        if pending is None:
            return None
        asked = pending.num_tokens
        proposals: dict[str, m.Proposal] = {}
        for proposal in result.proposals:
            request = requests.get(proposal.request_id)
            if request is None or proposal.request_id not in asked:
                continue
            problem = proposal_problem(proposal, asked[proposal.request_id], vocab_size, request.num_tokens)
            if problem:
                report(problem)
                request.draft.reset()
                continue
            # Whatever happens to the step, the draft service now holds this.
            request.draft.num_stable, request.draft.num_proposed = proposal.num_held, len(proposal.token_ids)
            if proposal.num_held == 0:  # it started the sequence over: it holds no features either
                request.draft.num_features = 0
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

    def give_up(self, pending: PendingProposal, requests: dict[str, Request], *, answer_may_come: bool) -> None:
        """What the draft holds for these requests is unknown until its answer comes, if it does."""
        self._pending.pop(pending.propose_id, None)
        if answer_may_come:
            self._abandoned[pending.propose_id] = pending
        for request_id in pending.num_tokens:
            if (request := requests.get(request_id)) is not None:
                request.draft.reset()

    def lose(self, draft: WorkerRecord, requests: dict[str, Request]) -> list[PendingProposal]:
        """The draft service went: the pending requests to give up (no answer will come); none if it was not in use."""
        if self._in_use != (draft.worker_id, draft.incarnation):
            return []  # not the one proposals went to: nothing depends on it
        self._in_use = None
        forget_views(requests.values())
        self._abandoned.clear()
        return list(self._pending.values())

    def forget_later(self, request: Request) -> None:
        """A finished request the draft service holds: it is told to forget it at the end of the event."""
        if request.draft.known:
            self._forget.append(request.request_id)

    def take_forget(self) -> list[str]:
        forget, self._forget = self._forget, []
        return forget


def forget_views(requests: Iterable[Request]) -> None:
    for request in requests:
        request.draft.reset()
        request.draft.known = False
