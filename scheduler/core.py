"""The scheduler's functional core: every event in, every message to send out; no I/O, no clock of its own.

The asyncio shell (service.py) feeds it decoded messages with the current monotonic
time and sends what collects in `outbox`. Everything about requests, placement,
batching, lifecycle views and recovery is decided here and tested as plain code.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import msgspec

from common.logs import get_logger
from modeling.sampling import is_greedy
from proto import messages as m
from proto.lifecycle import INIT_PHASES, TERMINAL, TRANSITIONS, State
from scheduler.batching import BatchLimits, ScheduledSeq, plan_step
from scheduler.config import SchedulerConfig
from scheduler.drafting import DraftLink
from scheduler.registry import InFlightStep, StepSeq, WorkerRecord, least_loaded_ready, new_record
from scheduler.request import FINISH_REASONS, Request, RequestStatus
from scheduler.speculation import (
    PendingProposal,
    SpecCounters,
    SpecLimits,
    record_verification,
    speculation_plan,
    step_result_problem,
)

log = get_logger()

_SPEC_LOG_INTERVAL_S = 10.0  # speculation.stats is logged at most this often


@dataclass(frozen=True)
class Outgoing:
    to_worker: bool  # False: to a gateway
    identity: bytes
    message: msgspec.Struct


class RequestRejected(Exception):
    def __init__(self, code: m.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class SchedulerCore:
    def __init__(self, config: SchedulerConfig, rng: random.Random | None = None) -> None:
        self._config = config
        self._limits = BatchLimits(config.max_num_batched_tokens, config.max_num_seqs)
        self._rng = rng or random.Random()
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._waiting: deque[Request] = deque()
        self._workers: dict[str, WorkerRecord] = {}  # current incarnation of each worker id
        self._gateways: set[bytes] = set()
        self._target_fingerprint: str | None = None
        self._target_vocab_size = 0
        self._target_feature_width = 0  # the width of the features the targets return
        self._no_ready_target_since_s: float | None = 0.0  # None while a target worker is READY
        self._next_step_id = 0
        self.outbox: list[Outgoing] = []
        self._pending_deltas: dict[bytes, list[m.TokenDelta]] = {}  # per gateway, sent as one frame per event
        self._target_vocab: str | None = None  # the targets' vocabulary fingerprint
        self._drafts = DraftLink(config.propose_timeout_s)
        self.spec = SpecCounters()
        self._spec_logged_s = 0.0

    # ------------------------------------------------------------------ views

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._requests) - len(self._waiting)

    def has_ready_target(self) -> bool:
        return any(w.is_ready and w.is_target for w in self._workers.values())

    def _current_draft(self) -> WorkerRecord | None:
        return self._drafts.current(self._workers, self._requests.values())

    def info(self, query_id: int, now_s: float) -> m.InfoReply:
        return m.InfoReply(
            query_id=query_id, model_name=self._config.model_name, max_model_len=self._config.max_model_len,
            num_waiting=self.num_waiting, num_running=self.num_running,
            processes=[w.info(now_s) for w in self._workers.values()],
            speculation=self.spec.info(),
        )

    # ------------------------------------------------------------------ gateway events

    def on_gateway_message(self, identity: bytes, message: m.GatewayToScheduler, now_s: float) -> None:
        self._on_gateway_message(identity, message, now_s)
        self._end_event()

    def _on_gateway_message(self, identity: bytes, message: m.GatewayToScheduler, now_s: float) -> None:
        match message:
            case m.GatewayHello():
                self._gateways.add(identity)
            case m.SubmitRequest():
                self._submit(identity, message, now_s)
            case m.AbortRequest():
                self._abort(message, now_s)
            case m.InfoQuery():
                self._to_gateway(identity, self.info(message.query_id, now_s))

    def knows_gateway(self, identity: bytes) -> bool:
        return identity in self._gateways

    def _submit(self, identity: bytes, submit: m.SubmitRequest, now_s: float) -> None:
        try:
            request = self._admit(identity, submit, now_s)
        except RequestRejected as exc:
            log.info("request.rejected", request_id=submit.request_id, code=exc.code, reason=exc.message)
            self._to_gateway(identity, m.RequestError(submit.request_id, exc.code, exc.message))
            return
        self._requests[request.request_id] = request
        self._waiting.append(request)
        log.info("request.queued", request_id=request.request_id, num_prompt_tokens=len(request.prompt_token_ids),
                 max_tokens=request.max_tokens, num_waiting=len(self._waiting))
        self._place_waiting()
        self._dispatch(now_s)

    def _admit(self, identity: bytes, submit: m.SubmitRequest, now_s: float) -> Request:
        limit = self._config.max_model_len
        num_prompt = len(submit.prompt_token_ids)
        if submit.request_id in self._requests:
            raise RequestRejected("INVALID_ARGUMENT", f"request_id {submit.request_id!r} is already in use")
        if num_prompt == 0:
            raise RequestRejected("INVALID_ARGUMENT", "prompt_token_ids is empty")
        if submit.max_tokens is not None and submit.max_tokens < 1:
            raise RequestRejected("INVALID_ARGUMENT", f"max_tokens must be at least 1, got {submit.max_tokens}")
        max_tokens = submit.max_tokens if submit.max_tokens is not None else limit - num_prompt
        if num_prompt + max(max_tokens, 1) > limit:
            raise RequestRejected(
                "INVALID_ARGUMENT",
                f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) exceeds the context of {limit} tokens",
            )
        if len(self._waiting) >= self._config.max_queue_len:
            raise RequestRejected("RESOURCE_EXHAUSTED", f"the queue is full ({self._config.max_queue_len} waiting requests)")
        sampling = submit.sampling
        if not submit.seed_given:
            sampling = msgspec.structs.replace(sampling, seed=self._rng.getrandbits(63))
        return Request(
            request_id=submit.request_id, gateway=identity, prompt_token_ids=list(submit.prompt_token_ids),
            max_tokens=max_tokens, sampling=sampling, stop_token_ids=frozenset(submit.stop_token_ids),
            waiting_since_s=now_s,
        )

    def _abort(self, abort: m.AbortRequest, now_s: float) -> None:
        request = self._requests.get(abort.request_id)
        if request is None:
            return  # already finished: nothing to do
        self._finish(request, RequestStatus.FINISHED_ABORTED, notify=False, reason=abort.reason)
        self._place_waiting()  # its slot may be the one a waiting request needs
        self._dispatch(now_s)

    # ------------------------------------------------------------------ worker events

    def on_worker_message(self, identity: bytes, message: m.WorkerToScheduler, now_s: float) -> bool:
        """Apply one worker message; False when it was dropped as stale or unexpected."""
        accepted = self._on_worker_message(identity, message, now_s)
        self._end_event()
        return accepted

    def _on_worker_message(self, identity: bytes, message: m.WorkerToScheduler, now_s: float) -> bool:
        if isinstance(message, m.WorkerHello):
            return self._on_hello(identity, message, now_s)
        worker = self._workers.get(message.worker_id)
        if worker is None or worker.incarnation != message.incarnation or worker.state in (State.DEAD, State.FAILED, State.STOPPED):
            return False
        worker.last_seen_s = now_s
        match message:
            case m.Heartbeat():
                worker.num_used_kv_slots = message.num_used_kv_slots
            case m.LifecycleReport():
                return self._on_lifecycle(worker, message, now_s)
            case m.WorkerFailed():
                worker.failure = f"{message.phase}: {message.error_type}: {message.message}"
                self._lose_worker(worker, State.FAILED, now_s)
            case m.StepResult():
                return self._on_step_result(worker, message, now_s)
            case m.StepRefused():
                log.error("step.refused", worker_id=worker.worker_id, step_id=message.step_id, reason=message.reason)
                worker.failure = f"refused a step: {message.reason}"
                self._lose_worker(worker, State.FAILED, now_s)
            case m.ProposeResult():
                return self._on_proposal(worker, message, now_s)
            case m.ProposeRefused() if worker.state is State.DRAINING:  # on its way out it takes no work: no fault
                log.info("propose.refused_while_draining", worker_id=worker.worker_id, propose_id=message.propose_id)
                if (pending := self._drafts.pending(message.propose_id)) is not None:
                    self._give_up_proposal(pending, now_s, answer_may_come=False)
            case m.ProposeRefused():
                log.error("propose.refused", worker_id=worker.worker_id, propose_id=message.propose_id, reason=message.reason)
                worker.failure = f"refused a propose request: {message.reason}"
                self._lose_worker(worker, State.FAILED, now_s)
        return True

    def _on_hello(self, identity: bytes, hello: m.WorkerHello, now_s: float) -> bool:
        known = self._workers.get(hello.worker_id)
        if known is not None and (known.incarnation == hello.incarnation
                                  or (known.incarnation > hello.incarnation and known.state not in TERMINAL)):
            return False  # a repeated hello, or a stale one (an older incarnation) while the known one lives
        # A gone incarnation is replaced by any other: one started after it may still read an earlier clock.
        if known is not None and known.state not in TERMINAL:
            known.failure = known.failure or "replaced by a new incarnation"
            self._lose_worker(known, State.DEAD, now_s)
        worker = new_record(hello, identity, now_s)
        self._workers[hello.worker_id] = worker
        problem = self._incompatibility(hello)
        log.info("worker.hello", worker_id=hello.worker_id, incarnation=hello.incarnation, role=hello.role,
                 fingerprint=hello.model_fingerprint, num_kv_slots=hello.num_kv_slots, refused=problem)
        if problem:
            self._refuse(worker, problem)
        elif hello.role != "target":
            self._drafts.note_hello(worker)
        else:
            self._target_fingerprint = self._target_fingerprint or hello.model_fingerprint
            self._target_vocab = self._target_vocab or hello.vocab_fingerprint
            self._target_vocab_size = hello.vocab_size
            self._target_feature_width = hello.feature_width
            for draft in [w for w in self._workers.values() if not w.is_target and w.state not in TERMINAL]:
                if draft_problem := self._draft_incompatibility(draft.hello):
                    self._refuse(draft, draft_problem)
        return True

    def _refuse(self, worker: WorkerRecord, problem: str) -> None:
        log.error("worker.refused", worker_id=worker.worker_id, incarnation=worker.incarnation, role=worker.hello.role,
                  reason=problem)
        worker.failure = f"refused: {problem}"
        worker.state = State.FAILED
        self.outbox.append(Outgoing(True, worker.identity, m.Drain(worker.incarnation)))

    def _incompatibility(self, hello: m.WorkerHello) -> str:
        if hello.protocol_version != m.PROTOCOL_VERSION:
            return f"protocol version {hello.protocol_version}, the scheduler speaks {m.PROTOCOL_VERSION}"
        if hello.num_kv_slots < 1:
            return "it has no KV slot"
        if hello.max_model_len < self._config.max_model_len:
            return f"max_model_len {hello.max_model_len} is below the scheduler's {self._config.max_model_len}"
        if hello.role == "draft":
            return self._draft_incompatibility(hello)
        if self._target_fingerprint not in (None, hello.model_fingerprint):
            return f"model fingerprint {hello.model_fingerprint} differs from the other replicas' {self._target_fingerprint}"
        return ""

    def _draft_incompatibility(self, hello: m.WorkerHello) -> str:
        """A draft must propose in the targets' vocabulary; one that works on any (n-gram) always fits.

        A draft trained for one target (it names the target's fingerprint) serves only that
        target, and one that reads target features needs them at its width.
        """
        if self._target_vocab and hello.vocab_fingerprint and hello.vocab_fingerprint != self._target_vocab:
            return (f"the draft's vocabulary (fingerprint {hello.vocab_fingerprint}, {hello.vocab_size} tokens) differs "
                    f"from the target's (fingerprint {self._target_vocab}, {self._target_vocab_size} tokens)")
        if self._target_fingerprint and hello.target_fingerprint and hello.target_fingerprint != self._target_fingerprint:
            return (f"the draft was trained for another target model (fingerprint {hello.target_fingerprint}, "
                    f"the target's is {self._target_fingerprint})")
        if self._target_feature_width and hello.feature_width and hello.feature_width != self._target_feature_width:
            return f"the draft reads features of width {hello.feature_width}, the target's are {self._target_feature_width} wide"
        return ""

    def _on_lifecycle(self, worker: WorkerRecord, report: m.LifecycleReport, now_s: float) -> bool:
        """Follow a reported transition; one the table does not allow is dropped as a protocol error."""
        try:
            state = State(report.state)
        except ValueError:
            return False
        if state not in TRANSITIONS[worker.state]:
            log.warning("worker.illegal_transition", worker_id=worker.worker_id, state=worker.state, reported=state)
            return False
        log.info("worker.lifecycle", worker_id=worker.worker_id, incarnation=worker.incarnation, state=state)
        if state in (State.FAILED, State.STOPPED):
            self._lose_worker(worker, state, now_s)
            return True
        worker.state = state
        worker.state_since_s = now_s
        if state is State.READY and worker.is_target and report.max_draft_tokens is not None:
            worker.max_draft_tokens = max(0, min(worker.max_draft_tokens, report.max_draft_tokens))
            log.warning("worker.speculation_limited", worker_id=worker.worker_id, max_draft_tokens=worker.max_draft_tokens,
                        note="0: its steps are not batch invariant, so it serves without speculation (see its log)")
        if state is State.READY and worker.is_target:
            self._no_ready_target_since_s = None
            self._place_waiting()
        if state is State.DRAINING and not worker.is_target:
            self._lose_draft(worker, now_s)  # no proposal goes to a draining draft service
        self._dispatch(now_s)
        return True

    def _on_step_result(self, worker: WorkerRecord, result: m.StepResult, now_s: float) -> bool:
        step = worker.in_flight
        if step is None or step.step_id != result.step_id:
            return False
        outputs = {o.request_id: o for o in result.outputs}
        problem = step_result_problem(step.seqs, outputs)
        if problem:
            worker.failure = f"step {step.step_id}: {problem}"
            self._lose_worker(worker, State.FAILED, now_s)
            return True
        worker.in_flight = None
        for seq in step.seqs:
            request = seq.request
            if worker.requests.get(request.request_id) is not request:
                continue  # finished or aborted while the step ran; its slot is already released
            request.num_computed_tokens += seq.num_tokens
            if seq.samples:
                output = outputs[request.request_id]
                request.num_computed_tokens += output.num_accepted_draft
                record_verification(request, seq, output, self.spec)
                self._append_tokens(request, output.token_ids)
        for features in result.features:
            owner = self._requests.get(features.request_id)
            if owner is None or worker.requests.get(features.request_id) is not owner:
                continue
            if problem := owner.features.problem(features.rows):
                self._errors_from(worker, "bad_features", problem)
                owner.features.clear()
            elif not owner.features.put(features.rows):
                owner.features.clear()  # a gap (the steps before were not asked for features): none until recomputed
        self._place_waiting()
        self._dispatch(now_s)
        return True

    def _on_proposal(self, draft: WorkerRecord, result: m.ProposeResult, now_s: float) -> bool:
        answered = self._drafts.answer(result, self._requests, self._target_vocab_size,
                                       lambda problem: self._errors_from(draft, "bad_proposal", problem))
        if answered is None:
            return False
        self._step_after_proposal(*answered, now_s)
        return True

    def _step_after_proposal(self, pending: PendingProposal, proposals: dict[str, m.Proposal], now_s: float) -> None:
        """Send the step that waited for this propose request, if its worker still waits for it."""
        worker = self._workers.get(pending.worker_id)
        if worker is not None and worker.incarnation == pending.worker_incarnation and worker.awaiting_proposal == pending.propose_id:
            worker.awaiting_proposal = None
            if worker.runs_steps:
                self._send_step(worker, pending.plan, proposals, now_s)

    def _errors_from(self, worker: WorkerRecord, kind: str, problem: str) -> None:
        log.warning("worker.protocol_error", worker_id=worker.worker_id, kind=kind, problem=problem)

    # ------------------------------------------------------------------ time

    def check_timeouts(self, now_s: float) -> None:
        self._check_timeouts(now_s)
        self._end_event()

    def _check_timeouts(self, now_s: float) -> None:
        cfg = self._config
        for worker in list(self._workers.values()):
            if worker.state in TERMINAL:
                continue
            if worker.state in INIT_PHASES and now_s - worker.state_since_s > cfg.phase_timeout_s:
                worker.failure = f"{worker.state} ran past its {cfg.phase_timeout_s:g} s deadline (--phase-timeout-s)"
                self._lose_worker(worker, State.FAILED, now_s)
            elif now_s - worker.last_seen_s > cfg.heartbeat_timeout_s:
                worker.failure = f"no heartbeat for {now_s - worker.last_seen_s:.1f} s (--heartbeat-timeout-s {cfg.heartbeat_timeout_s})"
                self._lose_worker(worker, State.DEAD, now_s)
            elif worker.in_flight and now_s - worker.in_flight.sent_at_s > cfg.step_timeout_s:
                worker.failure = f"step {worker.in_flight.step_id} unanswered for {cfg.step_timeout_s} s (--step-timeout-s)"
                self._lose_worker(worker, State.DEAD, now_s)
        for pending in self._drafts.timed_out(now_s):
            log.warning("propose.timeout", propose_id=pending.propose_id, waited_s=round(now_s - pending.sent_at_s, 3),
                        note="the step runs without proposals (--propose-timeout-s)")
            self._give_up_proposal(pending, now_s, answer_may_come=True)
        if now_s - self._spec_logged_s >= _SPEC_LOG_INTERVAL_S and self.spec.num_draft_tokens:
            self._spec_logged_s = now_s
            log.info("speculation.stats", **msgspec.structs.asdict(self.spec.info()))
        if not self.has_ready_target():
            if self._no_ready_target_since_s is None:
                self._no_ready_target_since_s = now_s
            since_s = self._no_ready_target_since_s
            for request in [r for r in self._waiting if now_s - max(since_s, r.waiting_since_s) > cfg.no_worker_timeout_s]:
                self._fail(request, "UNAVAILABLE", f"no READY worker within {cfg.no_worker_timeout_s} s (--no-worker-timeout-s)")

    # ------------------------------------------------------------------ internals

    def _place_waiting(self) -> None:
        """Give waiting requests a slot on the least-loaded READY worker, first come first served."""
        while self._waiting:
            worker = least_loaded_ready(list(self._workers.values()))
            if worker is None:
                return
            request = self._waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.worker_id = worker.worker_id
            request.slot = worker.take_slot()
            worker.requests[request.request_id] = request
            log.debug("request.placed", request_id=request.request_id, worker_id=worker.worker_id, slot=request.slot)

    def _dispatch(self, now_s: float) -> None:
        for worker in self._workers.values():
            if worker.state is State.DRAINING and not worker.requests and not worker.is_busy and not worker.told_to_stop:
                worker.told_to_stop = True  # drained: it may stop now
                self.outbox.append(Outgoing(True, worker.identity, m.Drain(worker.incarnation)))
            elif worker.is_target and worker.runs_steps and not worker.is_busy and worker.requests:
                plan = plan_step(list(worker.requests.values()), self._limits)
                if plan:
                    self._propose_or_step(worker, plan, now_s)

    def _propose_or_step(self, worker: WorkerRecord, plan: list[ScheduledSeq], now_s: float) -> None:
        """Ask the draft service for proposals first when the policy says so; otherwise step at once."""
        draft = self._current_draft()
        cfg = self._config
        num_tokens: dict[str, int] = {}
        if draft is not None:
            limits = SpecLimits(
                num_speculative_tokens=min(cfg.num_speculative_tokens, worker.max_draft_tokens, draft.hello.max_draft_tokens),
                spec_disable_batch_threshold=cfg.spec_disable_batch_threshold,
                spec_draft_token_budget=cfg.spec_draft_token_budget,
                max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=cfg.max_model_len,
            )
            num_tokens = self._drafts.with_features(draft, speculation_plan(plan, limits), self._requests)
        self.spec.decide(max(num_tokens.values(), default=0))
        if draft is None or not num_tokens:
            self._send_step(worker, plan, {}, now_s)
            return
        self.outbox.append(Outgoing(True, draft.identity, self._drafts.propose(draft, worker, plan, num_tokens, now_s)))

    def _give_up_proposal(self, pending: PendingProposal, now_s: float, *, answer_may_come: bool) -> None:
        """Step without proposals."""
        self._drafts.give_up(pending, self._requests, answer_may_come=answer_may_come)
        self._step_after_proposal(pending, {}, now_s)

    def _send_step(self, worker: WorkerRecord, plan: list[ScheduledSeq], proposals: dict[str, m.Proposal], now_s: float) -> None:
        # A plan that waited for proposals may have lost requests on the way (finished, aborted).
        plan = [item for item in plan if worker.requests.get(item.request.request_id) is item.request]
        if not plan:
            self._dispatch(now_s)
            return
        self._next_step_id += 1
        seqs: list[m.SeqWork] = []
        step_seqs: list[StepSeq] = []
        for item in plan:
            r = item.request
            assert r.slot is not None  # placed requests hold a slot
            start = r.num_computed_tokens
            proposal = proposals.get(r.request_id)
            drafts = proposal.token_ids if proposal else []
            parents = proposal.parents if proposal else None  # a tree of point masses (checked on arrival)
            seqs.append(m.SeqWork(
                request_id=r.request_id, slot=r.slot, start_position=start,
                token_ids=r.token_slice(start, start + item.num_tokens) + drafts, sample=item.completes, sampling=r.sampling,
                num_draft_tokens=len(drafts), draft_dists=proposal.dists if proposal and not is_greedy(r.sampling) else None,
                draft_parents=parents,
            ))
            step_seqs.append(StepSeq(r, item.num_tokens, item.completes, drafts, r.draft.generation, parents))
        worker.in_flight = InFlightStep(self._next_step_id, now_s, step_seqs)
        self.outbox.append(Outgoing(True, worker.identity, m.StepRequest(self._next_step_id, worker.incarnation, seqs,
                                                                         return_features=self._drafts.features_wanted)))

    def _append_tokens(self, request: Request, token_ids: list[int]) -> None:
        emitted: list[int] = []
        status = None
        for token in token_ids:
            request.output_token_ids.append(token)
            emitted.append(token)
            status = request.finish_status_after_append(self._config.max_model_len)
            if status is not None:
                break
        self._emit(request, emitted, None)
        if status is not None:
            self._finish(request, status, notify=True)

    def _emit(self, request: Request, token_ids: list[int], finish_reason: m.FinishReason | None) -> None:
        if not token_ids and finish_reason is None:
            return
        self._pending_deltas.setdefault(request.gateway, []).append(m.TokenDelta(
            request_id=request.request_id, token_ids=token_ids, finish_reason=finish_reason,
            num_prompt_tokens=len(request.prompt_token_ids), num_completion_tokens=len(request.output_token_ids),
            num_draft_tokens=request.num_draft_tokens, num_accepted_draft_tokens=request.num_accepted_draft_tokens,
            num_verify_steps=request.num_verify_steps,
        ))

    def _to_gateway(self, identity: bytes, message: msgspec.Struct) -> None:
        """Any other message to a gateway goes after the deltas already pending for it."""
        self._flush_deltas(identity)
        self.outbox.append(Outgoing(False, identity, message))

    def _end_event(self) -> None:
        """What collects during one event goes out as one frame per destination."""
        self._flush_deltas()
        forget = self._drafts.take_forget()
        if not forget:
            return
        draft = self._current_draft()
        if draft is not None:
            self.outbox.append(Outgoing(True, draft.identity, m.ReleaseSequences(draft.incarnation, forget)))

    def _flush_deltas(self, only: bytes | None = None) -> None:
        for gateway in [only] if only is not None else list(self._pending_deltas):
            deltas = self._pending_deltas.pop(gateway, None)
            if deltas:
                self.outbox.append(Outgoing(False, gateway, m.TokenDeltas(deltas)))

    def _finish(self, request: Request, status: RequestStatus, *, notify: bool, reason: str = "") -> None:
        self._release(request)
        self._drafts.forget_later(request)
        request.status = status
        del self._requests[request.request_id]
        log.info("request.finished", request_id=request.request_id, status=status.value, reason=reason or None,
                 num_completion_tokens=len(request.output_token_ids), num_draft_tokens=request.num_draft_tokens,
                 num_accepted_draft_tokens=request.num_accepted_draft_tokens, num_verify_steps=request.num_verify_steps)
        if notify and status in FINISH_REASONS:
            self._emit(request, [], FINISH_REASONS[status])

    def _fail(self, request: Request, code: m.ErrorCode, message: str) -> None:
        self._finish(request, RequestStatus.FAILED, notify=False, reason=message)
        self._to_gateway(request.gateway, m.RequestError(request.request_id, code, message))

    def _release(self, request: Request) -> None:
        """Take the request off its worker or the queue, freeing its KV slot at once."""
        if request.status is RequestStatus.WAITING:
            self._waiting.remove(request)
            return
        worker = self._workers.get(request.worker_id or "")
        if worker is not None and request.slot is not None and worker.requests.pop(request.request_id, None) is not None:
            worker.give_back_slot(request.slot)
            # Sent on the step socket: the worker applies it after any step in flight.
            self.outbox.append(Outgoing(True, worker.identity, m.ReleaseSlots(worker.incarnation, [request.slot])))
        request.worker_id = request.slot = None

    def _lose_draft(self, draft: WorkerRecord, now_s: float) -> None:
        """Steps go on without speculation; a new incarnation starts from nothing."""
        for pending in self._drafts.lose(draft, self._requests):
            self._give_up_proposal(pending, now_s, answer_may_come=False)

    def _lose_worker(self, worker: WorkerRecord, state: State, now_s: float) -> None:
        """The worker will run nothing more: its requests go back to the front of the queue.

        It is told to stop as well: one given up on while still alive (silent too long, a
        refused step, a bad result) would otherwise run on, heartbeating, with nobody to
        serve and no supervisor to restart it. A dead one never reads it.
        """
        log.warning("worker.lost", worker_id=worker.worker_id, incarnation=worker.incarnation, state=state,
                    failure=worker.failure, num_requeued=len(worker.requests))
        if not worker.told_to_stop:
            worker.told_to_stop = True
            self.outbox.append(Outgoing(True, worker.identity, m.Drain(worker.incarnation)))
        worker.state = state
        worker.in_flight = None
        worker.awaiting_proposal = None  # its pending proposal, when answered, only updates the draft views
        if not worker.is_target:
            self._lose_draft(worker, now_s)
            return
        for request in reversed(list(worker.requests.values())):
            request.status = RequestStatus.WAITING
            request.worker_id = request.slot = None
            request.num_computed_tokens = 0  # recomputed from prompt + tokens already streamed
            request.waiting_since_s = now_s
            self._waiting.appendleft(request)
        worker.requests.clear()
        worker.free_slots = []
        self._place_waiting()
        self._dispatch(now_s)

