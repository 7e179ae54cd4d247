"""The scheduler's functional core: every event in, every message to send out; no I/O, no clock of its own.

The asyncio shell (service.py) feeds it decoded messages with the current monotonic
time and sends what collects in `outbox`. This module handles each event and the
verdicts on processes. What ends when a process or a gateway is lost is endings.py, the
step cycle (plan -> propose -> step -> apply) stepping.py, requests requests.py, worker
records workers.py, and everything about speculation speculation/.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from functools import partial
from typing import assert_never

from common.logs import get_logger
from common.step_shape import StepShape
from common.protocol_errors import ProtocolErrors
from proto import messages as m
from proto.messages import MAX_STEP_TIMINGS
from proto.lifecycle import TRANSITIONS, State
from scheduler.config import SchedulerConfig
from scheduler.endings import Endings
from scheduler.gateways import GatewayRegistry
from scheduler.outbox import Outbox
from scheduler.requests import RequestRejected, RequestStatus, RequestTable, token_problem
from scheduler.speculation.link import DraftLink
from scheduler.stepping import StepCycle, protocol_error
from scheduler.workers import MAX_KERNELS_CHARS, WorkerRecord, WorkerRegistry, hello_problem

log = get_logger()


class SchedulerCore:
    """`peer_connected(identity)`: whether a worker socket with that routing identity is connected now (the shell asks
    ZeroMQ); it decides whether a second hello for a worker id comes from a restarted process or from an impostor."""

    def __init__(self, config: SchedulerConfig, rng: random.Random | None = None,
                 peer_connected: Callable[[bytes], bool] = lambda identity: True) -> None:
        self._config = config
        self._peer_connected = peer_connected
        self._requests = RequestTable(config.max_model_len, config.max_queue_len, rng or random.Random(),
                                      by_priority=config.scheduling_policy == "priority")
        self._workers = WorkerRegistry(config.max_model_len)
        self._drafts = DraftLink(config)
        self.outbox = Outbox()
        self._steps = StepCycle(config, self._requests, self._workers, self._drafts, self.outbox)
        self._gateways = GatewayRegistry(config.heartbeat_timeout_s, config.gateway_gone_grace_s)
        self._endings = Endings(config, self._requests, self._drafts, self._steps, self.outbox)
        # What the shell drops from each socket before (or after) the core sees it, exported with info().
        self.protocol_errors = {"gateway": ProtocolErrors("scheduler.gateway"), "worker": ProtocolErrors("scheduler.worker")}
        self._no_ready_target_since_s: float | None = 0.0  # None while a target worker is READY

    # ------------------------------------------------------------------ views

    @property
    def num_waiting(self) -> int:
        return self._requests.num_waiting

    @property
    def num_running(self) -> int:
        return self._requests.num_running

    @property
    def num_speculation_states(self) -> int:
        """Requests whose speculation state (draft view, acceptance, features) is kept: none once all have finished."""
        return len(self._drafts.states)

    def has_ready_target(self) -> bool:
        return self._workers.has_ready_target()

    def knows_gateway(self, identity: bytes) -> bool:
        return identity in self._gateways

    def gateways_to_probe(self) -> list[bytes]:
        """The gateways believed connected: the shell routes a Probe to each every tick, and tells
        `on_gateway_unreachable` about any whose connection is gone."""
        return self._gateways.connected()

    def info(self, query_id: int, now_s: float) -> m.InfoReply:
        return m.InfoReply(
            query_id=query_id, model_name=self._config.model_name, max_model_len=self._config.max_model_len,
            num_waiting=self.num_waiting, num_running=self.num_running,
            processes=[w.info(now_s) for w in self._workers  # at most what a gateway takes (proto/frames.py)
                       if w.is_live or now_s - w.state_since_s <= self._config.gone_listed_s][: m.MAX_LISTED_PROCESSES],
            speculation=self._drafts.counters.info(),
            protocol_errors={f"{socket}.{kind}": count for socket, errors in self.protocol_errors.items()
                             for kind, count in errors.counts.items()},
            num_gateways=len(self._gateways), num_gone_gateways=self._endings.num_gone_gateways,
            num_orphaned_requests=self._endings.num_orphaned_requests,
        )

    # ------------------------------------------------------------------ events in

    def on_gateway_message(self, identity: bytes, message: m.GatewayToScheduler, now_s: float) -> None:
        self._gateways.heard(identity, now_s)
        match message:
            case m.GatewayHello() | m.GatewayHeartbeat():
                self._greet(identity, message, now_s)
            case m.SubmitRequest():
                self._submit(identity, message, now_s)
            case m.AbortRequest():
                request = self._requests.get(message.request_id)
                if request is not None and request.gateway != identity:  # a gateway ends only its own requests
                    self.protocol_errors["gateway"].record("not_owner", message="abort", request_id=message.request_id)
                elif request is not None:  # else already finished
                    self._steps.finish(request, RequestStatus.FINISHED_ABORTED, notify=False, reason=message.reason[:200])
            case m.InfoQuery():
                if message.flush_prefix_cache:
                    flushed = sum(w.pages.flush() for w in self._workers if w.pages is not None)
                    log.info("prefix_cache.flushed", num_pages=flushed)
                self.outbox.to_gateway(identity, self.info(message.query_id, now_s))
            case _:
                assert_never(message)
        self._end_event(now_s)

    def on_gateway_unreachable(self, identity: bytes, now_s: float) -> None:
        """A message routed to this gateway found no connection (ROUTER_MANDATORY): it is missing from now; its
        requests are aborted unless it comes back within --gateway-gone-grace-s (check_timeouts)."""
        self._gateways.unreachable(identity, now_s)

    def on_worker_message(self, identity: bytes, message: m.WorkerToScheduler, now_s: float) -> bool:
        """Apply one worker message; False when it was dropped as stale or unexpected."""
        accepted = self._on_worker_message(identity, message, now_s)
        self._end_event(now_s)
        return accepted

    def check_timeouts(self, now_s: float) -> None:
        cfg = self._config
        for worker, verdict, failure in self._workers.overdue(now_s, cfg.phase_timeout_s, cfg.heartbeat_timeout_s,
                                                              cfg.step_timeout_s):
            worker.failure = failure
            self._endings.lose_worker(worker, verdict, now_s)
        for pending in self._drafts.timed_out(now_s):
            log.warning("propose.timeout", propose_id=pending.propose_id, waited_s=round(now_s - pending.sent_at_s, 3),
                        note="the step runs without proposals (--propose-timeout-s)")
            self._steps.give_up_proposal(pending, now_s, answer_may_come=True)
        for gateway in self._gateways.gone(now_s):
            self._endings.orphan_requests(gateway, now_s, f"the gateway was {gateway.missing_because} for more than "
                                                  f"{self._config.gateway_gone_grace_s:g} s (--gateway-gone-grace-s)")
        self._drafts.log_stats(now_s)
        if not self.has_ready_target():
            if self._no_ready_target_since_s is None:
                self._no_ready_target_since_s = now_s
            since_s = self._no_ready_target_since_s
            failure = f"no READY worker within {cfg.no_worker_timeout_s} s (--no-worker-timeout-s)"
            for request in [r for r in self._requests.waiting
                            if now_s - max(since_s, r.waiting_since_s) > cfg.no_worker_timeout_s]:
                self._steps.fail(request, "UNAVAILABLE", failure)
        self._end_event(now_s)

    def _greet(self, identity: bytes, greeting: m.GatewayHello | m.GatewayHeartbeat, now_s: float) -> None:
        """A gateway speaking this protocol is known from its hello, or from any heartbeat (one given up on while its
        connection stayed up is known again)."""
        if greeting.protocol_version != m.PROTOCOL_VERSION:
            self.protocol_errors["gateway"].record("bad_hello", gateway_id=greeting.gateway_id[:64],
                                                   problem=f"protocol version {greeting.protocol_version}, the "
                                                           f"scheduler speaks {m.PROTOCOL_VERSION}")
            return
        replaced = self._gateways.greet(identity, greeting.gateway_id[:256], greeting.incarnation[:64], now_s)
        if replaced is not None:  # a new process under the old one's identity: nobody reads the old one's requests
            self._endings.orphan_requests(replaced, now_s, "the gateway that sent it was restarted", notify=False)

    def _submit(self, identity: bytes, submit: m.SubmitRequest, now_s: float) -> None:
        try:
            request = self._requests.admit(identity, submit, now_s, vocab_size=self._workers.target_vocab_size)
        except RequestRejected as exc:
            log.info("request.rejected", request_id=submit.request_id, code=exc.code, reason=exc.message)
            self.outbox.to_gateway(identity, m.RequestError(submit.request_id, exc.code, exc.message))
            return
        log.info("request.queued", request_id=request.request_id, num_prompt_tokens=len(request.prompt_token_ids),
                 max_tokens=request.max_tokens, num_waiting=self.num_waiting)

    def _on_worker_message(self, identity: bytes, message: m.WorkerToScheduler, now_s: float) -> bool:
        if isinstance(message, m.WorkerHello):
            return self._on_hello(identity, message, now_s)
        worker = self._workers.current(message.worker_id, message.incarnation)
        if worker is None:
            return False
        if not worker.sent_by(identity, message):  # believed only from the sockets of the process that said the hello
            self.protocol_errors["worker"].record("not_owner", message=type(message).__name__, worker_id=message.worker_id)
            return False
        worker.last_seen_s = now_s
        match message:
            case m.Heartbeat():
                worker.num_used_kv_pages = message.num_used_kv_pages
                worker.protocol_errors = message.protocol_errors
            case m.LifecycleReport():
                return self._on_lifecycle(worker, message, now_s)
            case m.WorkerFailed():
                worker.failure = f"{message.phase}: {message.error_type}: {message.message}"
                self._endings.lose_worker(worker, State.FAILED, now_s)
            case m.StepResult():
                booked = self._steps.apply(worker, message, now_s)
                if not booked.answers:
                    return False
                if booked.problem:
                    worker.failure = booked.problem
                    self._endings.lose_worker(worker, State.FAILED, now_s)
            case m.StepRefused():
                if not self._refused_for_its_request(worker, message, now_s):
                    log.error("step.refused", worker_id=worker.worker_id, step_id=message.step_id, reason=message.reason)
                    worker.failure = f"refused a step: {message.reason}"
                    self._endings.lose_worker(worker, State.FAILED, now_s)
            case m.ProposeResult():
                answered = self._drafts.answer(message, self._requests, self._workers.target_vocab_size,
                                               partial(protocol_error, worker, "bad_proposal"), now_s)
                if answered is None:
                    return False
                self._steps.step_after_proposal(*answered, now_s)
            case m.ProposeRefused() if worker.state is State.DRAINING:  # on its way out it takes no work: no fault
                log.info("propose.refused_while_draining", worker_id=worker.worker_id, propose_id=message.propose_id)
                if (pending := self._drafts.pending(message.propose_id)) is not None:
                    self._steps.give_up_proposal(pending, now_s, answer_may_come=False)
            case m.ProposeRefused():
                log.error("propose.refused", worker_id=worker.worker_id, propose_id=message.propose_id, reason=message.reason)
                worker.failure = f"refused a propose request: {message.reason}"
                self._endings.lose_worker(worker, State.FAILED, now_s)
            case _:
                assert_never(message)
        return True

    def _refused_for_its_request(self, worker: WorkerRecord, refused: m.StepRefused, now_s: float) -> bool:
        """A step refused for one request's own content: that request fails alone; the worker, which ran nothing of
        the step, is not at fault and its other sequences are planned again."""
        step = worker.in_flight
        if not refused.request_id or step is None or step.step_id != refused.step_id:
            return False
        request = next((s.request for s in step.seqs if s.request.request_id == refused.request_id), None)
        if request is None:
            return False
        log.warning("request.refused_by_worker", request_id=request.request_id, worker_id=worker.worker_id,
                    reason=refused.reason)
        worker.in_flight = None
        self._steps.fail(request, "INVALID_ARGUMENT", f"the worker refused the request: {refused.reason}")
        return True

    def _on_hello(self, identity: bytes, hello: m.WorkerHello, now_s: float) -> bool:
        if problem := hello_problem(hello, time.time_ns()):  # checked in full before any record is built
            self.protocol_errors["worker"].record("bad_hello", worker_id=hello.worker_id[:64], problem=problem)
            return False
        is_new, replaced = self._workers.replaced_by(hello)
        if not is_new:
            return False
        if replaced is not None and replaced.identity != identity and self._peer_connected(replaced.identity):
            self._refuse_duplicate(identity, hello, replaced)
            return True
        if replaced is not None:
            replaced.failure = replaced.failure or "replaced by a new incarnation"
            self._endings.lose_worker(replaced, State.DEAD, now_s)
        worker = self._workers.register(hello, identity, now_s, prefix_cache=self._config.prefix_cache)
        problem = self._workers.incompatibility(hello)
        log.info("worker.hello", worker_id=hello.worker_id, incarnation=hello.incarnation, role=hello.role,
                 fingerprint=hello.model_fingerprint, num_kv_pages=hello.num_kv_pages, kv_page_size=hello.kv_page_size,
                 refused=problem)
        if problem:
            self._refuse(worker, problem, now_s)
        elif not worker.is_target:
            self._drafts.note_hello(worker)
        else:
            vocabulary_was_known = bool(self._workers.target_vocab_size)
            for draft in self._workers.note_target(hello):
                self._refuse(draft, self._workers.draft_problem(draft.hello), now_s)
            if not vocabulary_was_known:
                self._refuse_out_of_vocabulary()
        return True

    def _refuse_duplicate(self, identity: bytes, hello: m.WorkerHello, live: WorkerRecord) -> None:
        """A hello for the id of a process whose connection is still up: the first one stays; the newcomer is told to
        stop (a restarted process is only ever started after its predecessor's connection closed)."""
        self.protocol_errors["worker"].record("duplicate_id", worker_id=hello.worker_id, incarnation=hello.incarnation)
        log.error("worker.duplicate_refused", worker_id=hello.worker_id, incarnation=hello.incarnation,
                  live_incarnation=live.incarnation,
                  note="a process with this id is connected; the one saying hello again is told to stop")
        self.outbox.to_worker(identity, m.Drain(hello.incarnation))

    def _refuse_out_of_vocabulary(self) -> None:
        """Requests queued before any target said hello were admitted without knowing the vocabulary: checked now,
        before a worker can see them (later ones are checked at admission)."""
        for request in self._requests.waiting:
            if problem := token_problem(request, self._workers.target_vocab_size):
                self._steps.fail(request, "INVALID_ARGUMENT", problem)

    def _refuse(self, worker: WorkerRecord, problem: str, now_s: float) -> None:
        log.error("worker.refused", worker_id=worker.worker_id, incarnation=worker.incarnation, role=worker.hello.role,
                  reason=problem)
        worker.failure = f"refused: {problem}"
        worker.move_to(State.FAILED, now_s)
        self.outbox.to_worker(worker.identity, m.Drain(worker.incarnation))

    def _on_lifecycle(self, worker: WorkerRecord, report: m.LifecycleReport, now_s: float) -> bool:
        """Follow a reported transition; one the table does not allow is dropped as a protocol error."""
        state = report.state
        if state not in TRANSITIONS[worker.state]:
            log.warning("worker.illegal_transition", worker_id=worker.worker_id, state=worker.state, reported=state)
            return False
        log.info("worker.lifecycle", worker_id=worker.worker_id, incarnation=worker.incarnation, state=state)
        if state in (State.FAILED, State.STOPPED):
            self._endings.lose_worker(worker, state, now_s)
            return True
        worker.move_to(state, now_s)
        if state is State.READY:
            worker.kernels = report.kernels[:MAX_KERNELS_CHARS]
        if state is State.READY and worker.is_target:
            worker.batch_invariant = report.batch_invariant
            for timing in report.step_timings[:MAX_STEP_TIMINGS]:  # what rows cost, before any speculative step
                worker.cost.observe_warm_up(StepShape(timing.decode_rows, timing.prefill_tokens, timing.attended),
                                            timing.duration_ms)
            log.info("worker.step_cost", worker_id=worker.worker_id, batch_invariant=worker.batch_invariant,
                     speculation_policy=self._config.speculation_policy,
                     fitted=[round(c, 4) for c in worker.cost.coefficients() or ()],
                     terms="fixed ms; ms per decode row up to 8, 9-32, beyond; ms more per row under a grammar; ms per "
                           "prefill token; ms per thousand attended positions",
                     note="the policy weighs these, the wait for proposals and each request's acceptance")
        if state is State.READY and worker.is_target and report.max_draft_tokens is not None:
            worker.max_draft_tokens = max(0, min(worker.max_draft_tokens, report.max_draft_tokens))
            log.warning("worker.speculation_limited", worker_id=worker.worker_id, max_draft_tokens=worker.max_draft_tokens,
                        note="0: its steps are not batch invariant and it was told --require-batch-invariance")
        if state is State.READY and worker.is_target:
            self._no_ready_target_since_s = None
        if state is State.DRAINING and not worker.is_target:
            self._endings.lose_draft(worker, now_s)  # no proposal goes to a draining draft service
        return True

    # ------------------------------------------------------------------ endings

    def _end_event(self, now_s: float) -> None:
        """Requests placed and steps dispatched (the one place: StepCycle.settle), then what collected during the event
        goes out as one frame per destination.

        Token deltas wait while a target waits for proposals: the draft service's answer and
        the step it lets go are what keeps the target idle, and a gateway woken to stream
        meanwhile takes the core they need (on two cores, the round trip doubled). The deltas
        go with the event that sends the step, a round trip later; a proposal not answered in
        --propose-timeout-s is given up on, so they never wait longer.
        """
        self._steps.settle(now_s)
        if not any(w.awaiting_proposal is not None for w in self._workers):
            self.outbox.flush_deltas()
        forget = self._drafts.take_forget()
        if forget and (draft := self._drafts.current(self._workers)) is not None:
            self.outbox.to_worker(draft.identity, m.ReleaseSequences(draft.incarnation, forget))
