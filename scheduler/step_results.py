"""What a target answers a step with, booked: a result's tokens streamed, its requests finished or moved on, its
pages cut back to the tokens that stand and the filled ones cached, its verification counted; or a refusal of one
request's content, which fails that request alone."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from common.logs import get_logger
from common.step_shape import step_shape
from proto import messages as m
from scheduler.config import SchedulerConfig
from scheduler.finishing import Finisher
from scheduler.outbox import Outbox
from scheduler.request_table import RequestTable
from scheduler.requests import Request, RequestStatus
from scheduler.speculation.link import DraftLink
from scheduler.speculation.verification import logprobs_problem, record_verification, step_result_problem
from scheduler.workers import WorkerRecord

log = get_logger()


@dataclass(frozen=True)
class Booked:
    """What a StepResult was to its worker's step in flight (StepResults.apply)."""

    answers: bool  # it answers the step in flight; else it is stale (a step given up on), and dropped
    problem: str = ""  # why it cannot be used: the worker is at fault


STALE = Booked(answers=False)
BOOKED = Booked(answers=True)


class StepResults:
    def __init__(
        self, config: SchedulerConfig, requests: RequestTable, drafts: DraftLink, finisher: Finisher, outbox: Outbox
    ) -> None:
        self._max_model_len = config.max_model_len
        self._requests = requests
        self._drafts = drafts
        self._finisher = finisher
        self._outbox = outbox

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
        self._drafts.counters.stepped(
            (now_s - step.planned_at_s) * 1000 - result.duration_ms,
            step.asked,
            (step.sent_at_s - step.planned_at_s) * 1000,
        )
        worker.explore.earn(result.duration_ms)
        worker.cost.observe(
            step_shape(
                [
                    (
                        seq.num_tokens,
                        len(seq.draft_token_ids),
                        seq.computed_before,
                        seq.samples and seq.request.grammar is not None,
                    )
                    for seq in step.seqs
                ]
            ),
            result.duration_ms,
        )
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
                record_verification(
                    request, seq, output, self._drafts.counters, self._drafts.states.of(request.request_id)
                )
                request.forced_token_ids = output.forced_token_ids
                if request.max_tokens == 0:  # the prompt was scored, nothing is generated
                    self._finisher.finish(request, RequestStatus.FINISHED_LENGTH, notify=True)
                else:
                    self._append_tokens(request, output.token_ids, output.logprobs)
                    if output.grammar_complete and self._requests.get(request.request_id) is request:
                        # Its grammar is complete: nothing else may follow.
                        self._finisher.finish(request, RequestStatus.FINISHED_STOPPED, notify=True)
        self._drafts.store_features(worker, result.features, partial(protocol_error, worker, "bad_features"))
        return BOOKED

    def refused_for_its_request(self, worker: WorkerRecord, refused: m.StepRefused) -> bool:
        """A step refused for one request's own content: that request fails alone; the worker, which ran nothing of
        the step, is not at fault and its other sequences are planned again."""
        step = worker.in_flight
        if not refused.request_id or step is None or step.step_id != refused.step_id:
            return False
        request = next((s.request for s in step.seqs if s.request.request_id == refused.request_id), None)
        if request is None:
            return False
        log.warning(
            "request.refused_by_worker",
            request_id=request.request_id,
            worker_id=worker.worker_id,
            reason=refused.reason,
        )
        worker.in_flight = None
        self._finisher.fail(request, "INVALID_ARGUMENT", f"the worker refused the request: {refused.reason}")
        return True

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
            status = request.finish_status_after_append(self._max_model_len)
            if status is not None:
                break
        self._outbox.emit(request, emitted, None, logprobs=None if logprobs is None else logprobs[: len(emitted)])
        if status is not None:
            self._finisher.finish(request, status, notify=True)


def protocol_error(worker: WorkerRecord, kind: str, problem: str) -> None:
    """A message part from `worker` that cannot be used (dropped; the rest of the message stands)."""
    log.warning("worker.protocol_error", worker_id=worker.worker_id, kind=kind, problem=problem)
