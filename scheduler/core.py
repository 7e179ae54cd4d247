"""The scheduler's functional core: every event in, every message to send out; no I/O, no clock of its own.

The asyncio shell (service.py) feeds it decoded messages with the current monotonic
time and sends what collects in `outbox`. This module takes each event to what handles
it and ends every event the same way (`_end_event`): a worker's hello and lifecycle
reports go to worker_lifecycle.py, a step's result to step_results.py, what a lost process
or gateway ends to endings.py; the step cycle is stepping.py, a request's end
finishing.py, the requests request_table.py, and everything about speculation speculation/.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial
from typing import assert_never

from common.logs import get_logger
from common.protocol_errors import ProtocolErrors
from proto import messages as m
from proto.lifecycle import State
from scheduler.admission import RequestRejected
from scheduler.config import SchedulerConfig
from scheduler.endings import Endings
from scheduler.finishing import Finisher
from scheduler.gateways import GatewayRegistry
from scheduler.outbox import Outbox
from scheduler.request_table import RequestTable
from scheduler.requests import RequestStatus
from scheduler.speculation.link import DraftLink
from scheduler.step_results import StepResults, protocol_error
from scheduler.stepping import StepCycle
from scheduler.worker_lifecycle import WorkerLifecycle
from scheduler.workers import WorkerRegistry

log = get_logger()


class SchedulerCore:
    """`peer_connected(identity)`: whether a worker socket with that routing identity is connected now (the shell asks
    ZeroMQ); it decides whether a second hello for a worker id comes from a restarted process or from an impostor."""

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        wall_clock_ns: Callable[[], int],
        rng: random.Random | None = None,
        peer_connected: Callable[[bytes], bool] = lambda identity: True,
    ) -> None:
        self._config = config
        self._requests = RequestTable(
            config.max_model_len,
            config.max_queue_len,
            rng or random.Random(),
            by_priority=config.scheduling_policy == "priority",
        )
        self._workers = WorkerRegistry(config.max_model_len)
        self._drafts = DraftLink(config)
        self.outbox = Outbox()
        # What the shell drops from each socket before (or after) the core sees it, exported with info().
        self.protocol_errors = {side: ProtocolErrors(f"scheduler.{side}") for side in ("gateway", "worker")}
        self._finisher = Finisher(self._requests, self._workers, self._drafts, self.outbox)
        self._steps = StepCycle(config, self._requests, self._workers, self._drafts, self._finisher, self.outbox)
        self._results = StepResults(config, self._requests, self._drafts, self._finisher, self.outbox)
        self._gateways = GatewayRegistry(config.heartbeat_timeout_s, config.gateway_gone_grace_s)
        self._endings = Endings(config, self._requests, self._drafts, self._finisher, self._steps, self.outbox)
        self._lifecycle = WorkerLifecycle(
            config,
            self._workers,
            self._requests,
            self._drafts,
            self._finisher,
            self._endings,
            self.outbox,
            self.protocol_errors["worker"],
            peer_connected,
            wall_clock_ns,
        )

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
            query_id=query_id,
            model_name=self._config.model_name,
            max_model_len=self._config.max_model_len,
            num_waiting=self.num_waiting,
            num_running=self.num_running,
            processes=[
                w.info(now_s)
                for w in self._workers  # at most what a gateway takes (proto/frames.py)
                if w.is_live or now_s - w.state_since_s <= self._config.gone_listed_s
            ][: m.MAX_LISTED_PROCESSES],
            speculation=self._drafts.counters.info(),
            protocol_errors={
                f"{socket}.{kind}": count
                for socket, errors in self.protocol_errors.items()
                for kind, count in errors.counts.items()
            },
            num_gateways=len(self._gateways),
            num_gone_gateways=self._endings.num_gone_gateways,
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
                    self._finisher.finish(
                        request, RequestStatus.FINISHED_ABORTED, notify=False, reason=message.reason[:200]
                    )
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
        for worker, verdict, failure in self._workers.overdue(
            now_s, cfg.phase_timeout_s, cfg.heartbeat_timeout_s, cfg.step_timeout_s
        ):
            worker.failure = failure
            self._endings.lose_worker(worker, verdict, now_s)
        for pending in self._drafts.proposals.timed_out(now_s):
            log.warning(
                "propose.timeout",
                propose_id=pending.propose_id,
                waited_s=round(now_s - pending.sent_at_s, 3),
                note="the step runs without proposals (--propose-timeout-s)",
            )
            self._steps.give_up_proposal(pending, now_s, answer_may_come=True)
        for gateway in self._gateways.gone(now_s):
            self._endings.orphan_requests(
                gateway,
                now_s,
                f"the gateway was {gateway.missing_because} for more than "
                f"{self._config.gateway_gone_grace_s:g} s (--gateway-gone-grace-s)",
            )
        self._drafts.log_stats(now_s)
        if (since_s := self._lifecycle.without_target_since_s(now_s)) is not None:
            failure = f"no READY worker within {cfg.no_worker_timeout_s} s (--no-worker-timeout-s)"
            for request in [
                r for r in self._requests.waiting if now_s - max(since_s, r.waiting_since_s) > cfg.no_worker_timeout_s
            ]:
                self._finisher.fail(request, "UNAVAILABLE", failure)
        self._end_event(now_s)

    def _greet(self, identity: bytes, greeting: m.GatewayHello | m.GatewayHeartbeat, now_s: float) -> None:
        """A gateway speaking this protocol is known from its hello, or from any heartbeat (one given up on while its
        connection stayed up is known again)."""
        if greeting.protocol_version != m.PROTOCOL_VERSION:
            self.protocol_errors["gateway"].record(
                "bad_hello",
                gateway_id=greeting.gateway_id[:64],
                problem=f"protocol version {greeting.protocol_version}, the scheduler speaks {m.PROTOCOL_VERSION}",
            )
            return
        replaced = self._gateways.greet(identity, greeting.gateway_id[:256], greeting.incarnation[:64], now_s)
        if replaced is not None:  # a new process under the old one's identity: nobody reads the old one's requests
            self._endings.orphan_requests(replaced, now_s, "the gateway that sent it was restarted", notify=False)

    def _submit(self, identity: bytes, submit: m.SubmitRequest, now_s: float) -> None:
        try:
            request = self._requests.admit(identity, submit, now_s, vocab_size=self._workers.target_vocab_size)
            self._drafts.record_prompt(request)
        except RequestRejected as exc:
            log.info("request.rejected", request_id=submit.request_id, code=exc.code, reason=exc.message)
            self.outbox.to_gateway(identity, m.RequestError(submit.request_id, exc.code, exc.message))
            return
        log.info(
            "request.queued",
            request_id=request.request_id,
            num_prompt_tokens=len(request.prompt_token_ids),
            max_tokens=request.max_tokens,
            num_waiting=self.num_waiting,
        )

    def _on_worker_message(self, identity: bytes, message: m.WorkerToScheduler, now_s: float) -> bool:
        if isinstance(message, m.WorkerHello):
            return self._lifecycle.hello(identity, message, now_s)
        worker = self._workers.current(message.worker_id, message.incarnation)
        if worker is None:
            return False
        if not worker.sent_by(identity, message):  # believed only from the sockets of the process that said the hello
            self.protocol_errors["worker"].record(
                "not_owner", message=type(message).__name__, worker_id=message.worker_id
            )
            return False
        worker.last_seen_s = now_s
        match message:
            case m.Heartbeat():
                worker.num_used_kv_pages = message.num_used_kv_pages
                worker.protocol_errors = message.protocol_errors
            case m.LifecycleReport():
                return self._lifecycle.reported(worker, message, now_s)
            case m.WorkerFailed():
                self._endings.fail_worker(worker, f"{message.phase}: {message.error_type}: {message.message}", now_s)
            case m.StepResult():
                booked = self._results.apply(worker, message, now_s)
                if not booked.answers:
                    return False
                if booked.problem:
                    self._endings.fail_worker(worker, booked.problem, now_s)
            case m.StepRefused():
                if not self._results.refused_for_its_request(worker, message):
                    log.error(
                        "step.refused", worker_id=worker.worker_id, step_id=message.step_id, reason=message.reason
                    )
                    self._endings.fail_worker(worker, f"refused a step: {message.reason}", now_s)
            case m.ProposeResult():
                answered = self._drafts.proposals.answer(
                    message,
                    self._requests,
                    self._workers.target_vocab_size,
                    partial(protocol_error, worker, "bad_proposal"),
                    now_s,
                )
                if answered is None:
                    return False
                self._steps.step_after_proposal(*answered, now_s)
            case m.ProposeRefused() if worker.state is State.DRAINING:  # on its way out it takes no work: no fault
                log.info("propose.refused_while_draining", worker_id=worker.worker_id, propose_id=message.propose_id)
                if (pending := self._drafts.proposals.pending(message.propose_id)) is not None:
                    self._steps.give_up_proposal(pending, now_s, answer_may_come=False)
            case m.ProposeRefused():
                log.error(
                    "propose.refused", worker_id=worker.worker_id, propose_id=message.propose_id, reason=message.reason
                )
                self._endings.fail_worker(worker, f"refused a propose request: {message.reason}", now_s)
            case _:
                assert_never(message)
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
        self._drafts.tell_draft(self._workers, self.outbox)
