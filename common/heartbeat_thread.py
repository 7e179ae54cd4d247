"""A model process's heartbeat thread: its heartbeats, the deadline watchdog, and the end when the scheduler is gone.

It runs on a thread and a socket of its own, so heartbeats go on while a long phase or step
holds the main thread; for the same reason the watchdog lives here. A phase or step that
runs past its deadline is reported (WorkerFailed, on this socket) and ends the process at
once, as does a dropped connection to the scheduler or a handshake it refuses.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import zmq
import zmq.utils.monitor

from common.status_file import write_status_file
from common.transport import HANDSHAKE_EVENTS
from proto import frames
from proto import messages as m
from proto.lifecycle import State

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from common.process_config import ProcessConfig
    from common.protocol_errors import ProtocolErrors


class HeartbeatSource(Protocol):
    """What the heartbeat thread reads of its process (LifecycleProcess), each time afresh."""

    @property
    def process_id(self) -> str: ...
    @property
    def incarnation(self) -> int: ...
    @property
    def num_steps(self) -> int: ...
    @property
    def errors(self) -> ProtocolErrors: ...
    @property
    def state(self) -> State: ...
    def num_used_kv_pages(self) -> int: ...


@dataclass(frozen=True)
class Deadline:
    """A phase or step the watchdog times."""

    what: str  # what runs: a state, or "step N"
    end_s: float  # when it must end, on time.monotonic()
    limit: str  # the limit and the setting that sets it, for the report


class HeartbeatThread:
    """Heartbeats to the scheduler every heartbeat_interval_s until the process stops or fails; `start()` starts it."""

    def __init__(
        self,
        process: HeartbeatSource,
        config: ProcessConfig,
        context: zmq.Context[Any],
        identity: bytes,
        log: FilteringBoundLogger,
        lost_exit_status: int,
    ) -> None:
        self._process = process
        self._context = context
        self._identity = m.heartbeat_identity(identity)
        self._scheduler_address = config.scheduler_address
        self._transport = config.transport
        self._interval_s = config.heartbeat_interval_s
        self._status_file = config.status_file
        self._log = log
        self._lost_exit_status = lost_exit_status  # when the scheduler is gone
        self._codec: m.Codec[m.WorkerToScheduler] = m.Codec(m.WorkerToScheduler)  # its own encoder, its own thread
        self._deadline: Deadline | None = None

    def start(self) -> None:
        threading.Thread(target=self._run, name="heartbeat", daemon=True).start()

    def watch(self, what: str, timeout_s: float, setting: str) -> None:
        """From now on `what` runs, and must end within timeout_s (`setting` sets it)."""
        self._deadline = Deadline(what, time.monotonic() + timeout_s, f"{timeout_s:g} s, {setting}")

    def unwatch(self) -> None:
        """Nothing runs under a deadline now."""
        self._deadline = None

    def _run(self) -> None:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, self._identity)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, frames.HEARTBEAT_SOCKET_BYTES)
        self._transport.join(socket, "worker")
        monitor = socket.get_monitor_socket(HANDSHAKE_EVENTS)
        socket.connect(self._scheduler_address)
        connected = False
        process = self._process
        while process.state not in (State.STOPPED, State.FAILED):
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline.end_s:
                self._give_up(socket, deadline)
            while monitor.poll(0):
                event = zmq.utils.monitor.parse_monitor_message(monitor.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    connected = True
                elif event == zmq.EVENT_DISCONNECTED and connected:
                    self._scheduler_lost()
                elif (refused := self._transport.handshake_failure(event, "worker")) is not None:
                    self._refused_by_scheduler(refused)
            socket.send(
                self._codec.encode(
                    m.Heartbeat(
                        worker_id=process.process_id,
                        incarnation=process.incarnation,
                        state=process.state,
                        num_used_kv_pages=process.num_used_kv_pages(),
                        num_steps=process.num_steps,
                        protocol_errors=dict(process.errors.counts),
                    )
                )
            )
            time.sleep(self._interval_s)
        socket.close()

    def _scheduler_lost(self) -> None:
        """The connection to the scheduler dropped: the scheduler this process registered with is gone (a restarted
        one would never know it, and nothing it holds is wanted any more). End now, for a fresh start to register."""
        self._log.error(
            "process.scheduler_lost",
            address=self._scheduler_address,
            exit_status=self._lost_exit_status,
            note="the connection to the scheduler dropped; exiting so that a fresh start registers anew",
        )
        self._end_now(self._lost_exit_status)

    def _refused_by_scheduler(self, reason: str) -> None:
        """The scheduler refused the handshake: nothing this process says can reach it, and trying again will not
        change that until its keys do. End now, FAILED, with the cause."""
        self._log.error(
            "process.refused_by_scheduler",
            address=self._scheduler_address,
            transport=self._transport.describe(),
            reason=reason,
            exit_status=1,
        )
        self._end_now(1)

    def _give_up(self, socket: zmq.Socket[bytes], deadline: Deadline) -> None:
        """The watchdog: a phase or step ran past its deadline; report it and end the process now."""
        message = f"{deadline.what} ran past its deadline ({deadline.limit})"
        self._log.error("process.deadline_exceeded", what=deadline.what, limit=deadline.limit)
        socket.send(
            self._codec.encode(
                m.WorkerFailed(
                    worker_id=self._process.process_id,
                    incarnation=self._process.incarnation,
                    phase=self._process.state,
                    error_type="DeadlineExceeded",
                    message=message,
                )
            )
        )
        time.sleep(0.3)  # let ZeroMQ's I/O thread put the report on the wire; exiting skips the usual flush
        self._end_now(1)

    def _end_now(self, status: int) -> None:
        """End the process at once, from any thread, its status file saying FAILED."""
        if self._status_file is not None:
            write_status_file(self._status_file, State.FAILED)
        os._exit(status)
