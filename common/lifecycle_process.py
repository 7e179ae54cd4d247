"""What every model process (target worker, draft service) shares: announce, start in phases, serve, drain.

A subclass says who it is (`hello`), what its start-up phases do (`phases`) and how it
answers a message (`handle`); this class owns the socket to the scheduler, the
lifecycle and its reports, signals, and the rule that any exception during start-up ends
in FAILED with its phase and cause and exit 1. Heartbeats and the deadline watchdog run on
a thread of their own (common/heartbeat_thread.py).
"""

from __future__ import annotations

import abc
import argparse
import signal
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgspec
import zmq

from common.faults import FaultInjector
from common.heartbeat_thread import HeartbeatThread
from common.logs import get_logger
from common.process_config import ProcessConfig
from common.protocol_errors import ProtocolErrors
from common.status_file import write_status_file
from proto import messages as m
from proto.lifecycle import Lifecycle, State

log = get_logger()

T = TypeVar("T")

_POLL_MS = 100
# Exit status of a process the scheduler gave up on (told to stop without a signal), or whose scheduler went away:
# not a clean stop, so that a supervisor (`specserve up`, compose's restart: on-failure) starts a fresh one, which
# registers anew.
EXIT_DISMISSED = 3

Phase = tuple[State, Callable[[], None]]


@dataclass(frozen=True)
class ReadyDetails:
    """What a process found while starting, sent with READY (m.LifecycleReport's fields of the same names)."""

    max_draft_tokens: int | None = None  # a lower limit on draft tokens than the hello said (None: no change)
    kernels: str = ""  # which kernels its model runs on, as its engine says ("": it runs no model)
    batch_invariant: bool | None = None  # a target: whether its steps are batch invariant
    step_timings: list[m.StepTiming] = field(default_factory=list)  # a target: steps it timed while warming up
    graphs: str = ""  # a target: its captured graphs, or why it serves without them

    def fields(self) -> dict[str, Any]:
        return {
            "max_draft_tokens": self.max_draft_tokens,
            "kernels": self.kernels[: m.MAX_KERNELS_CHARS],
            "batch_invariant": self.batch_invariant,
            "graphs": self.graphs[: m.MAX_KERNELS_CHARS],
            "step_timings": self.step_timings,
        }


class LifecycleProcess(abc.ABC, Generic[T]):
    """One process talking to the scheduler over a DEALER socket. `run()` returns the exit code."""

    def __init__(self, process: ProcessConfig, inbound: object) -> None:
        self.process_id = process.worker_id
        self.incarnation = time.time_ns()
        self.errors = ProtocolErrors(process.worker_id)
        self.log = log.bind(worker_id=process.worker_id, incarnation=self.incarnation)
        self.num_steps = 0  # steps or proposals served, for heartbeats
        self._scheduler_address = process.scheduler_address
        self._transport = process.transport
        self._identity = m.worker_identity(process.worker_id, self.incarnation)
        self._status_file = process.status_file
        self._lifecycle = Lifecycle(self._on_transition)
        self._codec: m.Codec[T] = m.Codec(inbound)
        self._codec_out: m.Codec[m.WorkerToScheduler] = m.Codec(m.WorkerToScheduler)
        self._context = zmq.Context()
        self._heartbeats = HeartbeatThread(
            self, process, self._context, self._identity, self.log, lost_exit_status=EXIT_DISMISSED
        )
        self._socket = self._context.socket(zmq.DEALER)
        self._send_lock = threading.Lock()
        self._stop_requested = threading.Event()  # stop after the current message
        self._drain_requested = threading.Event()  # SIGTERM while READY: finish what runs, take nothing new
        self._dismissed = False  # told to stop by the scheduler, not by a signal
        self._drain_timeout_s = process.drain_timeout_s
        self._phase_timeout_s = process.phase_timeout_s
        self._step_timeout_s = process.step_timeout_s
        self.faults: FaultInjector | None = None

    # ------------------------------------------------------------------ what a subclass provides

    @abc.abstractmethod
    def hello(self) -> m.WorkerHello:
        """The announcement; may read the model's config, never load weights."""

    @abc.abstractmethod
    def phases(self) -> list[Phase]:
        """(state, work) for LOADING, ALLOCATING and WARMING, in order."""

    @abc.abstractmethod
    def handle(self, message: T) -> None:
        """Answer one decoded message other than Drain, whatever the state (refuse work unless READY)."""

    @abc.abstractmethod
    def max_frame_bytes(self) -> int:
        """The largest frame the scheduler may send this process (proto/frames.py), from its settings; asked after
        `hello`, before connecting (a larger frame drops the connection at its header)."""

    def num_used_kv_pages(self) -> int:
        """KV pages its own caches hold now, for heartbeats (0: none, or the scheduler counts them)."""
        return 0

    def ready_details(self) -> ReadyDetails:
        """What its READY report says beside the state: what it found while starting."""
        return ReadyDetails()

    # ------------------------------------------------------------------ shared behaviour

    @property
    def state(self) -> State:
        return self._lifecycle.state

    @property
    def runs_work(self) -> bool:
        """READY, or DRAINING: the work already placed here still runs to its end."""
        return self._lifecycle.state in (State.READY, State.DRAINING)

    def run(self) -> int:
        self._install_signal_handlers()
        if self._status_file is not None:  # at once: whatever an earlier process left there is replaced
            write_status_file(self._status_file, self._lifecycle.state)
        try:
            if not self._start():
                self._close()
                return self._exit_status()
        except Exception as exc:  # noqa: BLE001 - any init failure ends in FAILED, reported with its cause
            return self._fail(exc)
        try:
            self._serve()
        except Exception as exc:  # noqa: BLE001 - a crash while serving is fatal for this process
            return self._fail(exc)
        finally:
            self._close()
        return self._exit_status()

    def _exit_status(self) -> int:
        if self._dismissed:
            self.log.warning(
                "process.dismissed",
                exit_status=EXIT_DISMISSED,
                note="the scheduler told this process to stop without a signal (it gave up on it or "
                "refused it); exiting non-zero so that a supervisor starts a fresh one",
            )
            return EXIT_DISMISSED
        return 0

    def send(self, message: msgspec.Struct) -> None:
        with self._send_lock:
            self._socket.send(self._codec_out.encode(message))

    def _start(self) -> bool:
        """The start-up phases; True once READY, False when told to stop on the way."""
        self._socket.setsockopt(zmq.IDENTITY, self._identity)
        self._socket.setsockopt(zmq.LINGER, 2000)
        self._transport.join(self._socket, "worker")
        self.faults = FaultInjector(self.process_id)
        self._heartbeats.watch(State.STARTING, self._phase_timeout_s, "--phase-timeout-s")
        try:
            hello = self.hello()  # before connecting: what it reads sizes the frames this process takes
        finally:  # connected even when it failed, so that nothing sent after waits on a socket without a peer
            self._socket.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes())
            self._socket.connect(self._scheduler_address)
        self.send(hello)
        self._heartbeats.start()
        self.faults.at_phase(State.STARTING)  # after the hello, so that the scheduler sees what happens
        for state, work in self.phases():
            self._lifecycle.move_to(state)
            self._heartbeats.watch(state, self._phase_timeout_s, "--phase-timeout-s")
            self.faults.at_phase(state)
            work()
            self._handle_queued_messages()  # work sent before READY is refused, never run later
            if self._stop_requested.is_set():
                self._lifecycle.move_to(State.STOPPED)
                return False
        self._heartbeats.unwatch()
        self._lifecycle.move_to(State.READY)
        return True

    def run_step(self, work: Callable[[], None]) -> None:
        """Run one step (or proposal) under the step deadline, with any fault injected for it."""
        self._heartbeats.watch(f"step {self.num_steps + 1}", self._step_timeout_s, "--step-timeout-s")
        try:
            if self.faults is not None:
                self.faults.at_step(self.num_steps + 1)
            work()
        finally:
            self._heartbeats.unwatch()

    def _fail(self, exc: BaseException) -> int:
        phase = self._lifecycle.state
        self.log.error("process.failed", phase=phase, error_type=type(exc).__name__, error=str(exc), exc_info=exc)
        self.send(
            m.WorkerFailed(
                worker_id=self.process_id,
                incarnation=self.incarnation,
                phase=phase,
                error_type=type(exc).__name__[: m.MAX_NAME_CHARS],
                message=str(exc)[: m.MAX_REASON_CHARS],
            )
        )
        if self._lifecycle.state not in (State.FAILED, State.STOPPED):
            self._lifecycle.move_to(State.FAILED)
        self._close()
        return 1

    def _serve(self) -> None:
        """Serve until told to stop (Drain). After SIGTERM: DRAINING, serving what the scheduler still sends
        (the steps of requests already placed here) until it says Drain or --drain-timeout-s runs out."""
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        drain_until_s = float("inf")
        while not self._stop_requested.is_set():
            if self._drain_requested.is_set() and self.state is State.READY:
                self._lifecycle.move_to(State.DRAINING)
                drain_until_s = time.monotonic() + self._drain_timeout_s
            if time.monotonic() > drain_until_s:
                self.log.warning(
                    "process.drain_timeout",
                    drain_timeout_s=self._drain_timeout_s,
                    note="stopping with work left; the scheduler recomputes it elsewhere",
                )
                break
            if poller.poll(_POLL_MS):
                self._handle_frame(self._socket.recv())
        if self.state is State.READY:
            self._lifecycle.move_to(State.DRAINING)
        self._lifecycle.move_to(State.STOPPED)

    def _handle_queued_messages(self) -> None:
        while self._socket.poll(0):
            self._handle_frame(self._socket.recv())

    def _handle_frame(self, frame: bytes) -> None:
        try:
            message = self._codec.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.errors.record("decode", error=str(exc), num_bytes=len(frame))
            return
        if isinstance(message, m.Probe):  # the scheduler checking that this connection is up: nothing to do
            return
        if isinstance(message, m.Drain):
            if message.incarnation == self.incarnation:
                self._dismissed = not self._drain_requested.is_set()
                self._stop_requested.set()
            else:
                self.errors.record("stale_incarnation", message="drain", incarnation=message.incarnation)
            return
        self.handle(message)

    def _on_transition(self, old: State, new: State, duration_s: float) -> None:
        self.log.info("lifecycle.transition", previous=old, state=new, previous_duration_s=round(duration_s, 3))
        if self._status_file is not None:
            write_status_file(self._status_file, new)
        ready = new is State.READY
        self.send(
            m.LifecycleReport(
                worker_id=self.process_id,
                incarnation=self.incarnation,
                state=new,
                previous_state=old,
                previous_duration_s=duration_s,
                **(self.ready_details().fields() if ready else {}),
            )
        )

    def _install_signal_handlers(self) -> None:
        def on_signal(signum: int, frame: types.FrameType | None) -> None:
            if self._drain_requested.is_set() or self._stop_requested.is_set():
                raise SystemExit(1)  # a second signal: exit at once
            self.log.info("process.drain_requested", signal=signal.Signals(signum).name)
            self._drain_requested.set()
            if self._lifecycle.state is not State.READY:
                raise SystemExit(0)  # nothing in flight during start-up: stop at once

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def _close(self) -> None:
        self._socket.close(linger=2000)


def process_main(
    argv: list[str] | None,
    *,
    prog: str,
    description: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    build: Callable[[argparse.Namespace], LifecycleProcess[Any]],
) -> int:
    """`python -m <service>`: parse and check the arguments (a bad one is a usage error), configure logs, run."""
    from common import logs, slots

    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        slots.apply(args)
    except ValueError as exc:
        parser.error(str(exc))
    logs.configure(prog, json_logs=args.log_json or None)
    try:
        process = build(args)
    except ValueError as exc:
        parser.error(str(exc))
    return process.run()
