"""The step cycle of every target worker: plan -> propose -> step -> apply.

`settle`, at the end of every event, places waiting requests on workers (placement.py) and
dispatches: it plans a step for each idle target (batching.plan_step, with the draft tokens
the speculation link decides) and either asks the draft service for proposals or sends the
step at once; `step_after_proposal` sends a step whose proposals came (or were given up
on). A step's sequences get their pages when it is sent (paging.py); its result is booked
by step_results.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from common.logs import get_logger
from proto import messages as m
from proto.lifecycle import State
from scheduler.batching import BatchLimits, InFlightStep, ScheduledSeq, StepPlan, StepSeq, plan_step
from scheduler.config import SchedulerConfig
from scheduler.finishing import Finisher
from scheduler.outbox import Outbox
from scheduler.paging import StepPaging
from scheduler.placement import choose_worker, too_long_problem
from scheduler.request_table import RequestTable
from scheduler.requests import Request
from scheduler.speculation.acceptance import GRAMMAR
from scheduler.speculation.forced import forced_drafts
from scheduler.speculation.link import DraftLink
from scheduler.speculation.proposing import DraftWork, PendingProposal, draft_work
from scheduler.workers import WorkerRecord, WorkerRegistry

log = get_logger()


class StepCycle:
    def __init__(
        self,
        config: SchedulerConfig,
        requests: RequestTable,
        workers: WorkerRegistry,
        drafts: DraftLink,
        finisher: Finisher,
        outbox: Outbox,
    ) -> None:
        self._config = config
        self._limits = BatchLimits(config.max_num_batched_tokens, config.max_num_seqs)
        self._requests = requests
        self._workers = workers
        self._drafts = drafts
        self._finisher = finisher
        self._paging = StepPaging(requests, finisher)
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

    def place_waiting(self) -> None:
        """Give waiting requests pages on a READY worker (placement.choose_worker), first come first served.

        A request no worker's whole cache can hold fails at once, naming the limit.
        """
        while (request := self._requests.first_waiting()) is not None:
            targets = self._workers.ready_targets()
            if problem := too_long_problem(request, targets):
                self._finisher.fail(request, "INVALID_ARGUMENT", problem)
                continue
            # A feature-reading draft needs every position's target features, and prompt log-probabilities every prompt
            # position's logits: a cache hit would leave them out.
            share_prefix = not self._drafts.features_wanted and not request.scores_prompt
            placed = choose_worker(request, targets, self._config.max_num_seqs, share_prefix=share_prefix)
            if placed is None:
                return
            self._requests.start(request, placed.worker.worker_id, placed.num_cached_tokens)
            placed.worker.place(request)
            log.debug(
                "request.placed",
                request_id=request.request_id,
                worker_id=placed.worker.worker_id,
                num_cached_tokens=placed.num_cached_tokens,
            )

    def dispatch(self, now_s: float) -> None:
        """Plan a step for every idle target with work; tell a drained process it may stop."""
        for worker in self._workers:
            if (
                worker.state is State.DRAINING
                and not worker.requests
                and not worker.is_busy
                and not worker.told_to_stop
            ):
                worker.told_to_stop = True
                self._outbox.to_worker(worker.identity, m.Drain(worker.incarnation))
            elif worker.is_target and worker.runs_steps and not worker.is_busy and worker.requests:
                draft = self._drafts.current(self._workers)
                plan = plan_step(
                    self._step_candidates(worker), self._limits, partial(self._proposed_tokens, draft, worker)
                )
                if plan is None:
                    continue
                if draft is not None and plan.waits_for_proposals:
                    self._outbox.to_worker(draft.identity, self._drafts.proposals.propose(draft, worker, plan, now_s))
                else:
                    self._send(worker, plan, {}, now_s)

    def _proposed_tokens(
        self, draft: WorkerRecord | None, worker: WorkerRecord, seqs: Sequence[ScheduledSeq]
    ) -> dict[str, int]:
        """k per request the draft service is asked for: none for a request whose grammar forces its next tokens
        (those are its drafts, `forced_drafts`)."""
        return self._drafts.draft_tokens(draft, worker, [item for item in seqs if not self._forced(worker, item)])

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
                self._send(
                    worker,
                    pending.plan,
                    self._drafts.trim(worker, pending.plan, proposals),
                    now_s,
                    planned_at_s=pending.sent_at_s,
                    asked=asked,
                )

    def give_up_proposal(self, pending: PendingProposal, now_s: float, *, answer_may_come: bool) -> None:
        """Step without proposals."""
        self._drafts.proposals.give_up(pending, self._requests, answer_may_come=answer_may_come)
        self.step_after_proposal(pending, {}, now_s)

    def _send(
        self,
        worker: WorkerRecord,
        plan: StepPlan,
        proposals: dict[str, m.Proposal],
        now_s: float,
        *,
        planned_at_s: float | None = None,
        asked: tuple[int, int] | None = None,
    ) -> None:
        # A plan that waited for proposals may have lost requests on the way (finished, aborted).
        items = [item for item in plan.seqs if worker.requests.get(item.request.request_id) is item.request]
        work = self._paging.fit(worker, [(item, self._drafts_of(worker, item, proposals)) for item in items], now_s)
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
            forced = bool(drafts) and bool(self._forced(worker, item))
            generation = -1 if forced else self._drafts.draft_generation(r)
            proposal = proposals.get(r.request_id)
            source = GRAMMAR if forced else proposal.source if proposal is not None and drafts else ""
            end = start + item.num_tokens
            scores = r.scores_prompt and start < len(r.prompt_token_ids)
            reads_history = r.sampling.penalties is not None or r.grammar is not None
            seqs.append(
                m.SeqWork(
                    request_id=r.request_id,
                    pages=pages.block_table(r.request_id),
                    start_position=start,
                    token_ids=r.token_slice(start, end) + drafts,
                    sample=item.completes,
                    sampling=r.sampling,
                    num_draft_tokens=len(drafts),
                    draft_dists=dists,
                    draft_parents=parents,
                    logprobs=r.num_logprobs if item.completes else -1,
                    prompt_logprobs=r.num_prompt_logprobs if scores else -1,
                    after_token_id=r.prompt_token_ids[end] if scores and end < len(r.prompt_token_ids) else -1,
                    # Penalties and grammars read the tokens before the step; the worker holds none.
                    history=r.token_slice(0, start) if reads_history and item.completes else None,
                    num_prompt_tokens=r.num_own_prompt_tokens if reads_history else 0,
                    grammar=r.grammar if item.completes else None,
                )
            )
            # A prompt chunk's scores: each token's after the first, then the next chunk's first.
            prompt_scores = item.num_tokens - 1 + (end < len(r.prompt_token_ids)) if scores else None
            step_seqs.append(
                StepSeq(
                    r,
                    item.num_tokens,
                    item.completes,
                    drafts,
                    generation,
                    parents,
                    prompt_scores,
                    r.num_computed_tokens,
                    source,
                    proposal.chances if proposal is not None and drafts and not forced else None,
                )
            )
        worker.in_flight = InFlightStep(
            self._next_step_id, now_s, step_seqs, now_s if planned_at_s is None else planned_at_s, asked
        )
        self._outbox.to_worker(
            worker.identity,
            m.StepRequest(self._next_step_id, worker.incarnation, seqs, return_features=self._drafts.features_wanted),
        )

    def _drafts_of(self, worker: WorkerRecord, item: ScheduledSeq, proposals: dict[str, m.Proposal]) -> DraftWork:
        """What the step verifies for the sequence: the tokens its grammar forces, else its proposal, if any."""
        if forced := self._forced(worker, item):
            return forced, None, None
        return draft_work(item.request, proposals.get(item.request.request_id))

    def _forced(self, worker: WorkerRecord, item: ScheduledSeq) -> list[int]:
        return forced_drafts(item, worker.max_draft_tokens, self._config)
