"""The step cycle of every target worker: plan -> propose -> step -> apply.

`dispatch` plans a step for each idle target (batching.plan_step, with the draft tokens
the speculation link decides) and either asks the draft service for proposals or sends
the step at once; `step_after_proposal` sends a step whose proposals came (or were given
up on); `apply` books a step's result: tokens streamed, requests finished, draft views
moved on. Requests are placed on workers here too (scheduler/placement.py), and leave
here when they finish.

Pages. A step's sequences get the pages their new tokens need when it is sent. When a
worker has too few, a proposal that does not fit is dropped first (the step verifies
nothing for that sequence); then the most recently placed sequence on the worker (under
--scheduling-policy priority, the lowest priority's) is preempted by recompute: its pages go back, and it returns to the front of the queue to be
recomputed from its own tokens, as after a worker's death (its computed full pages stay
in the prefix cache, so the recompute is mostly a cache hit). After a step, pages past
the tokens that stand (rejected drafts) go back, and newly filled pages join the prefix
cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from common.defaults import NUM_SPECULATIVE_TOKENS
from common.logs import get_logger
from proto import messages as m
from proto.lifecycle import State
from scheduler.batching import BatchLimits, InFlightStep, ScheduledSeq, StepPlan, StepSeq, plan_step
from scheduler.config import SchedulerConfig
from scheduler.outbox import Outbox
from scheduler.placement import choose_worker, too_long_problem
from scheduler.requests import FINISH_REASONS, Request, RequestStatus, RequestTable
from common.step_shape import step_shape
from scheduler.speculation.acceptance import GRAMMAR
from scheduler.speculation.link import DraftLink, DraftWork, PendingProposal, draft_work
from scheduler.speculation.verification import logprobs_problem, record_verification, step_result_problem
from scheduler.workers import WorkerRecord, WorkerRegistry

log = get_logger()


@dataclass(frozen=True)
class Booked:
    """What a StepResult was to its worker's step in flight (StepCycle.apply)."""

    answers: bool  # it answers the step in flight; else it is stale (a step given up on), and dropped
    problem: str = ""  # why it cannot be used: the worker is at fault


STALE = Booked(answers=False)
BOOKED = Booked(answers=True)


class StepCycle:
    def __init__(self, config: SchedulerConfig, requests: RequestTable, workers: WorkerRegistry, drafts: DraftLink,
                 outbox: Outbox) -> None:
        self._config = config
        self._limits = BatchLimits(config.max_num_batched_tokens, config.max_num_seqs)
        self._requests = requests
        self._workers = workers
        self._drafts = drafts
        self._outbox = outbox
        self._next_step_id = 0
        self._unsettled = False  # a step found nothing to send during settle: its worker is to be dispatched again

    def settle(self, now_s: float) -> None:
        """The end of every event, the one place requests are placed and steps dispatched: waiting requests get pages,
        idle targets get steps, again while a step found nothing left to send (its worker is idle again)."""
        self._unsettled = True
        while self._unsettled:
            self._unsettled = False
            self.place_waiting()
            self.dispatch(now_s)

    def fail(self, request: Request, code: m.ErrorCode, problem: str) -> None:
        """The request fails alone: it leaves the scheduler, and its gateway is told why (a gRPC status code)."""
        self.finish(request, RequestStatus.FAILED, notify=False, reason=problem)
        self._outbox.to_gateway(request.gateway, m.RequestError(request.request_id, code, problem))

    def place_waiting(self) -> None:
        """Give waiting requests pages on a READY worker (placement.choose_worker), first come first served.

        A request no worker's whole cache can hold fails at once, naming the limit.
        """
        while (request := self._requests.first_waiting()) is not None:
            targets = self._workers.ready_targets()
            if problem := too_long_problem(request, targets):
                self.fail(request, "INVALID_ARGUMENT", problem)
                continue
            # A feature-reading draft needs every position's target features, and prompt log-probabilities every prompt
            # position's logits: a cache hit would leave them out.
            share_prefix = not self._drafts.features_wanted and not request.scores_prompt
            placed = choose_worker(request, targets, self._config.max_num_seqs, share_prefix=share_prefix)
            if placed is None:
                return
            self._requests.start(request, placed.worker.worker_id, placed.num_cached_tokens)
            placed.worker.place(request)
            log.debug("request.placed", request_id=request.request_id, worker_id=placed.worker.worker_id,
                      num_cached_tokens=placed.num_cached_tokens)

    def dispatch(self, now_s: float) -> None:
        """Plan a step for every idle target with work; tell a drained process it may stop."""
        for worker in self._workers:
            if worker.state is State.DRAINING and not worker.requests and not worker.is_busy and not worker.told_to_stop:
                worker.told_to_stop = True
                self._outbox.to_worker(worker.identity, m.Drain(worker.incarnation))
            elif worker.is_target and worker.runs_steps and not worker.is_busy and worker.requests:
                draft = self._drafts.current(self._workers)
                plan = plan_step(self._step_candidates(worker), self._limits,
                                 partial(self._proposed_tokens, draft, worker))
                if plan is None:
                    continue
                if draft is not None and plan.waits_for_proposals:
                    self._outbox.to_worker(draft.identity, self._drafts.propose(draft, worker, plan, now_s))
                else:
                    self._send(worker, plan, {}, now_s)

    def _proposed_tokens(self, draft: WorkerRecord | None, worker: WorkerRecord,
                         seqs: Sequence[ScheduledSeq]) -> dict[str, int]:
        """k per request the draft service is asked for: none for a request whose grammar forces its next tokens
        (those are its drafts, `_forced_drafts`)."""
        return self._drafts.draft_tokens(draft, worker, [item for item in seqs if not self._forced_drafts(worker, item)])

    def _forced_drafts(self, worker: WorkerRecord, item: ScheduledSeq) -> list[int]:
        """The tokens a decoding request's grammar forces next, as many as the step may verify (`--num-speculative-tokens`
        at most; 0 turns these off too): certain to be accepted (the grammar allows nothing else), whatever the batch
        size."""
        r = item.request
        if not r.forced_token_ids or not item.completes or item.num_tokens != 1:
            return []
        k = min(self._config.num_speculative_tokens if self._config.num_speculative_tokens is not None
                else NUM_SPECULATIVE_TOKENS, worker.max_draft_tokens, r.max_tokens - len(r.output_token_ids) - 1,
                self._config.max_model_len - r.num_tokens - 1)
        return r.forced_token_ids[: max(k, 0)]

    def _step_candidates(self, worker: WorkerRecord) -> list[Request]:
        """The requests the next step is planned from: a suspect (a request that was in flight when a worker was lost)
        alone, taking turns with a step of everyone else."""
        requests = list(worker.requests.values())
        suspects = [r for r in requests if r.suspect]
        if not suspects:
            return requests
        worker.suspect_turn = not worker.suspect_turn or len(suspects) == len(requests)
        return suspects[:1] if worker.suspect_turn else [r for r in requests if not r.suspect]

    def step_after_proposal(self, pending: PendingProposal, proposals: dict[str, m.Proposal], now_s: float) -> None:
        """Send the step that waited for this propose request, if its worker still waits for it."""
        worker = self._workers.current(pending.worker_id, pending.worker_incarnation)
        if worker is not None and worker.awaiting_proposal == pending.propose_id:
            worker.awaiting_proposal = None
            if worker.runs_steps:
                asked = (max(pending.plan.num_draft_tokens.values(), default=0), len(pending.plan.num_draft_tokens))
                self._send(worker, pending.plan, self._drafts.trim(worker, pending.plan, proposals), now_s,
                           planned_at_s=pending.sent_at_s, asked=asked)

    def give_up_proposal(self, pending: PendingProposal, now_s: float, *, answer_may_come: bool) -> None:
        """Step without proposals."""
        self._drafts.give_up(pending, self._requests, answer_may_come=answer_may_come)
        self.step_after_proposal(pending, {}, now_s)

    def _send(self, worker: WorkerRecord, plan: StepPlan, proposals: dict[str, m.Proposal], now_s: float, *,
              planned_at_s: float | None = None, asked: tuple[int, int] | None = None) -> None:
        # A plan that waited for proposals may have lost requests on the way (finished, aborted).
        items = [item for item in plan.seqs if worker.requests.get(item.request.request_id) is item.request]
        work = self._with_pages(worker, items, proposals, now_s)
        if not work:  # the worker is idle again, with what it holds still to run
            self._unsettled = True
            return
        pages = worker.pages
        assert pages is not None  # a target that runs steps
        self._next_step_id += 1
        seqs: list[m.SeqWork] = []
        step_seqs: list[StepSeq] = []
        for item, (drafts, dists, parents) in work:
            r = item.request
            start = r.num_computed_tokens
            # Forced drafts were not the draft service's: what it holds stays as it was.
            forced = bool(drafts) and bool(self._forced_drafts(worker, item))
            generation = -1 if forced else self._drafts.draft_generation(r)
            proposal = proposals.get(r.request_id)
            source = GRAMMAR if forced else proposal.source if proposal is not None and drafts else ""
            end = start + item.num_tokens
            scores = r.scores_prompt and start < len(r.prompt_token_ids)
            reads_history = r.sampling.penalties is not None or r.grammar is not None
            seqs.append(m.SeqWork(
                request_id=r.request_id, pages=pages.block_table(r.request_id), start_position=start,
                token_ids=r.token_slice(start, end) + drafts, sample=item.completes, sampling=r.sampling,
                num_draft_tokens=len(drafts), draft_dists=dists, draft_parents=parents,
                logprobs=r.num_logprobs if item.completes else -1, prompt_logprobs=r.num_prompt_logprobs if scores else -1,
                after_token_id=r.prompt_token_ids[end] if scores and end < len(r.prompt_token_ids) else -1,
                # Penalties and grammars read the tokens before the step; the worker holds none.
                history=r.token_slice(0, start) if reads_history and item.completes else None,
                num_prompt_tokens=r.num_own_prompt_tokens if reads_history else 0,
                grammar=r.grammar if item.completes else None,
            ))
            # A prompt chunk's scores: each token's after the first, then the next chunk's first.
            prompt_scores = item.num_tokens - 1 + (end < len(r.prompt_token_ids)) if scores else None
            step_seqs.append(StepSeq(r, item.num_tokens, item.completes, drafts, generation, parents, prompt_scores,
                                     r.num_computed_tokens, source))
        worker.in_flight = InFlightStep(self._next_step_id, now_s, step_seqs,
                                        now_s if planned_at_s is None else planned_at_s, asked)
        self._outbox.to_worker(worker.identity, m.StepRequest(self._next_step_id, worker.incarnation, seqs,
                                                              return_features=self._drafts.features_wanted))

    def _with_pages(self, worker: WorkerRecord, items: list[ScheduledSeq], proposals: dict[str, m.Proposal],
                    now_s: float) -> list[tuple[ScheduledSeq, DraftWork]]:
        """The step's sequences that got pages for their new tokens, each with the proposal it verifies.

        A proposal that does not fit is dropped; then the most recently placed sequence (by priority: the lowest
        priority's, `RequestTable.preemption_order`) is preempted until the pages are there. A sequence that alone needs more pages than
        the worker has finishes (its context is full).
        """
        pages = worker.pages
        assert pages is not None  # a target that runs steps
        preempted: set[str] = set()
        work: list[tuple[ScheduledSeq, DraftWork]] = []
        for item in items:
            r = item.request
            if r.request_id in preempted:
                continue
            drafts = draft_work(r, proposals.get(r.request_id))
            if forced := self._forced_drafts(worker, item):
                drafts = (forced, None, None)
            need = r.num_computed_tokens + item.num_tokens
            if drafts[0] and not pages.grow(r.request_id, need + len(drafts[0])):
                drafts = ([], None, None)  # verified never: the draft service drops it with the next request
            while r.request_id not in preempted and not pages.grow(r.request_id, need):
                victim = self._requests.preemption_order(worker.requests.values())[0]
                if victim is r and len(worker.requests) == 1:
                    log.warning("request.kv_cache_full", request_id=r.request_id, num_tokens=need,
                                num_kv_pages=pages.num_pages, note="alone it needs more pages than the worker has")
                    self.finish(r, RequestStatus.FINISHED_LENGTH, notify=True, reason="the KV cache is full")
                    preempted.add(r.request_id)
                    break
                self._preempt(worker, victim, now_s)
                preempted.add(victim.request_id)
            if r.request_id not in preempted:
                work.append((item, drafts))
        return [(item, drafts) for item, drafts in work if item.request.request_id not in preempted]

    def _preempt(self, worker: WorkerRecord, request: Request, now_s: float) -> None:
        """Free the request's pages; it waits at the front of the queue, to be recomputed from its own tokens."""
        worker.remove(request)
        worker.num_preemptions += 1
        request.num_preemptions += 1
        self._requests.requeue([request], now_s)
        log.info("request.preempted", request_id=request.request_id, worker_id=worker.worker_id,
                 num_tokens=request.num_tokens, num_preemptions=request.num_preemptions)

    def apply(self, worker: WorkerRecord, result: m.StepResult, now_s: float) -> Booked:
        """Book the result of the worker's step in flight."""
        step = worker.in_flight
        if step is None or step.step_id != result.step_id:
            return STALE
        outputs = {o.request_id: o for o in result.outputs}
        scored = {entry.request_id: entry for entry in result.prompt_logprobs}
        if problem := step_result_problem(step.seqs, outputs) or logprobs_problem(step.seqs, outputs, scored):
            return Booked(answers=True, problem=f"step {step.step_id}: {problem}")
        worker.in_flight = None
        # The target's time from the step's planning to its result, less the step itself: what the scheduler, the
        # sockets and, for a step that waited for proposals, the draft service kept it idle.
        self._drafts.counters.stepped((now_s - step.planned_at_s) * 1000 - result.duration_ms, step.asked,
                                      (step.sent_at_s - step.planned_at_s) * 1000)
        worker.explore.earn(result.duration_ms)
        worker.cost.observe(step_shape([(seq.num_tokens, len(seq.draft_token_ids), seq.computed_before,
                                         seq.samples and seq.request.grammar is not None)
                                        for seq in step.seqs]), result.duration_ms)
        pages = worker.pages
        assert pages is not None  # a target that runs steps
        for seq in step.seqs:
            request = seq.request
            if worker.requests.get(request.request_id) is not request:
                continue  # finished or aborted while the step ran; its pages are already released
            computed_before = request.num_computed_tokens
            request.num_computed_tokens += seq.num_tokens
            output = outputs[request.request_id] if seq.samples else None
            if output is not None:
                request.num_computed_tokens += output.num_accepted_draft
            # Rejected drafts' pages go back (a prompt's pages for its later chunks stay); the pages filled now join
            # the prefix cache.
            pages.truncate(request.request_id, max(request.num_computed_tokens, request.num_tokens))
            if request.num_computed_tokens // pages.page_size > computed_before // pages.page_size:
                standing = request.token_ids + (output.token_ids if output is not None else [])
                pages.register(request.request_id, standing[: request.num_computed_tokens])
            if request.request_id in scored:
                self._emit_prompt_logprobs(request, scored[request.request_id])
            if output is not None:
                record_verification(request, seq, output, self._drafts.counters, self._drafts.states.of(request.request_id))
                request.forced_token_ids = output.forced_token_ids
                if request.max_tokens == 0:  # the prompt was scored, nothing is generated
                    self.finish(request, RequestStatus.FINISHED_LENGTH, notify=True)
                else:
                    self._append_tokens(request, output.token_ids, output.logprobs)
                    if output.grammar_complete and self._requests.get(request.request_id) is request:
                        self.finish(request, RequestStatus.FINISHED_STOPPED, notify=True)  # nothing else may follow
        self._drafts.store_features(worker, result.features, partial(protocol_error, worker, "bad_features"))
        return BOOKED

    def _emit_prompt_logprobs(self, request: Request, scored: m.PromptLogprobs) -> None:
        """The entries for prompt positions still owed (a recomputed prompt's others were sent before)."""
        first = max(request.prompt_logprobs_done - scored.first_position, 0)
        last = len(request.prompt_token_ids) - scored.first_position
        entries = scored.entries[first:last]
        if entries:
            request.prompt_logprobs_done = scored.first_position + first + len(entries)
            self._outbox.emit(request, [], None, prompt_logprobs=entries)

    def _append_tokens(self, request: Request, token_ids: list[int], logprobs: list[m.TokenLogprob] | None) -> None:
        emitted: list[int] = []
        status = None
        for token in token_ids:
            request.output_token_ids.append(token)
            emitted.append(token)
            status = request.finish_status_after_append(self._config.max_model_len)
            if status is not None:
                break
        self._outbox.emit(request, emitted, None, logprobs=None if logprobs is None else logprobs[: len(emitted)])
        if status is not None:
            self.finish(request, status, notify=True)

    def finish(self, request: Request, status: RequestStatus, *, notify: bool, reason: str = "") -> None:
        """The request leaves the scheduler; its KV pages are free at once (a step in flight that writes them ends
        before the worker runs the next one, the only one that may reuse them)."""
        worker = self._workers.holding(request)
        if worker is not None:
            worker.remove(request)
        request.worker_id = None
        self._drafts.forget_later(request)
        self._requests.finish(request, status)
        log.info("request.finished", request_id=request.request_id, status=status.value, reason=reason or None,
                 num_completion_tokens=len(request.output_token_ids), num_draft_tokens=request.num_draft_tokens,
                 num_accepted_draft_tokens=request.num_accepted_draft_tokens, num_verify_steps=request.num_verify_steps)
        if notify and status in FINISH_REASONS:
            self._outbox.emit(request, [], FINISH_REASONS[status])


def protocol_error(worker: WorkerRecord, kind: str, problem: str) -> None:
    """A message part from `worker` that cannot be used (dropped; the rest of the message stands)."""
    log.warning("worker.protocol_error", worker_id=worker.worker_id, kind=kind, problem=problem)
