"""The scheduler's asyncio shell: receive from gateways and workers, feed the core, send its outbox."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import msgspec
import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

from common.logs import get_logger
from common.protocol_errors import ProtocolErrors
from common.status_file import LISTENING, write_status_file
from common.transport import ROLES, KeyCheck, Role
from proto import frames
from proto import messages as m
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore

log = get_logger()

T = TypeVar("T")

_TICK_S = 0.05
# ZeroMQ's own heartbeats on every connection: a peer silent this long (a host gone without closing its TCP
# connection) is disconnected, which frees its routing identity for the process that replaces it.
_ZMTP_HEARTBEAT_IVL_MS = 1000
_ZMTP_HEARTBEAT_TIMEOUT_MS = 5000
# A connection whose CURVE handshake is not done by then is dropped (libzmq's default is 30 s): with MAXMSGSIZE, what
# a peer without a key can make the scheduler hold is one frame of at most the socket's bound, for this long.
_HANDSHAKE_IVL_MS = 10_000
# Handshakes that failed before any key was checked (another mechanism, a wrong server key); refused keys are
# counted by KeyCheck.
_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


class SchedulerService:
    def __init__(self, config: SchedulerConfig) -> None:
        self._config = config
        self._core = SchedulerCore(config, wall_clock_ns=time.time_ns, peer_connected=self._worker_connected)
        self._context = zmq.asyncio.Context()
        self._gateway_socket = self._context.socket(zmq.ROUTER)
        self._worker_socket = self._context.socket(zmq.ROUTER)
        # A send to an identity with no connection raises (EHOSTUNREACH) instead of vanishing: how a probe learns that a
        # worker's connection is gone. The blocking view shares the socket, for the core's synchronous question.
        self._worker_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._worker_probe: zmq.Socket[bytes] = zmq.Socket.shadow(self._worker_socket.underlying)
        self._probe_frame = m.Codec(m.SchedulerToWorker).encode(m.Probe())
        # The same for gateways: a send to one whose connection closed (a killed process: the kernel closes its TCP
        # connection) raises, so the core learns within a tick that it is missing. Every send to a gateway is
        # non-blocking: one whose queue is full (a slow reader) drops the message, as a ROUTER does without this option,
        # and the loop never waits on one gateway (_send_to_gateway).
        self._gateway_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._gateway_probe_frame = m.Codec(m.SchedulerToGateway).encode(m.Probe())
        self._gateway_codec: m.Codec[m.GatewayToScheduler] = m.Codec(m.GatewayToScheduler)
        self._worker_codec: m.Codec[m.WorkerToScheduler] = m.Codec(m.WorkerToScheduler)
        self._gateway_errors = self._core.protocol_errors["gateway"]
        self._worker_errors = self._core.protocol_errors["worker"]
        self._stop = asyncio.Event()

    async def run(self) -> None:
        transport = self._config.transport
        authenticator = self._start_authenticator() if transport.secure else None
        sockets: dict[Role, tuple[zmq.asyncio.Socket, str]] = {
            "gateway": (self._gateway_socket, self._config.gateway_address),
            "worker": (self._worker_socket, self._config.worker_address),
        }
        monitors = {}
        max_frame_bytes = _max_frame_bytes(self._config)
        for role, (sock, address) in sockets.items():
            sock.setsockopt(zmq.LINGER, 0)
            # A larger frame drops its connection at its header, before the handshake as after it (proto/frames.py).
            sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes[role])
            sock.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_IVL_MS)
            # No ROUTER_HANDOVER: while a connection holds an identity, another connection claiming it is ignored.
            sock.setsockopt(zmq.HEARTBEAT_IVL, _ZMTP_HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ZMTP_HEARTBEAT_TIMEOUT_MS)
            transport.serve(sock, role)
            monitors[role] = sock.get_monitor_socket(_HANDSHAKE_FAILED)
            sock.bind(address)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._stop.set)
        if self._config.status_file is not None:
            write_status_file(self._config.status_file, LISTENING)
        log.info(
            "scheduler.listening",
            gateway_address=self._config.gateway_address,
            worker_address=self._config.worker_address,
            transport=transport.describe(),
            max_frame_bytes=max_frame_bytes,
        )
        if not transport.secure:
            log.warning(
                "scheduler.insecure",
                note="--insecure-loopback: any process on this machine can speak for a "
                "gateway or a worker; give --keys to authenticate them",
            )
        try:
            async with asyncio.TaskGroup() as tasks:
                receivers = [
                    tasks.create_task(self._receive_gateways(), name="receive-gateways"),
                    tasks.create_task(self._receive_workers(), name="receive-workers"),
                    tasks.create_task(self._tick(), name="timeouts"),
                    *(
                        tasks.create_task(self._count_failed_handshakes(role, monitor), name=f"handshakes-{role}")
                        for role, monitor in monitors.items()
                    ),
                ]
                await self._stop.wait()
                for task in receivers:
                    task.cancel()
        finally:
            for monitor in monitors.values():
                monitor.close()
            self._gateway_socket.close()
            self._worker_socket.close()
            if authenticator is not None:
                authenticator.stop()
            self._context.term()
        log.info("scheduler.stopped")

    def _start_authenticator(self) -> AsyncioAuthenticator:
        """ZAP for both sockets: a client's key must be in authorized/ROLE/ of the key folder; one that is not is
        refused in the handshake, counted and logged."""
        keys = self._config.keys
        assert keys is not None
        authenticator = AsyncioAuthenticator(self._context)
        authenticator.start()
        for role in ROLES:
            errors = self._core.protocol_errors[role]

            def refused(key: bytes, errors: ProtocolErrors = errors) -> None:
                errors.record("unauthorized_key", public_key=key.decode("ascii", "replace"))

            authenticator.configure_curve_callback(role, KeyCheck(keys, role, refused))
        return authenticator

    def _worker_connected(self, identity: bytes) -> bool:
        """Whether a worker socket with this routing identity is connected: a Probe is routed to it, or not."""
        try:
            self._worker_probe.send_multipart([identity, self._probe_frame], flags=zmq.NOBLOCK)
        except zmq.Again:  # its queue is full: it is there
            return True
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise
        return True

    async def _count_failed_handshakes(self, role: Role, monitor: zmq.asyncio.Socket) -> None:
        errors = self._core.protocol_errors[role]
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            errors.record("handshake_failed", zmq_event=zmq.Event(event["event"]).name, detail=event["value"])

    async def _receive_gateways(self) -> None:
        async for identity, message in _decoded(
            self._gateway_socket, self._gateway_codec, self._gateway_errors, self._refuse_unreadable
        ):
            if not isinstance(message, m.GatewayHello | m.GatewayHeartbeat) and not self._core.knows_gateway(identity):
                self._gateway_errors.record("unknown_sender", message=type(message).__name__)
                continue
            self._core.on_gateway_message(identity, message, time.monotonic())
            await self._flush()

    def _refuse_unreadable(self, identity: bytes, payload: bytes, problem: str) -> None:
        """A known gateway's submit that does not decode is answered, not only dropped: its client would wait for
        ever (the gateway checks its own submits first, so this is a defence in depth)."""
        request_id = unreadable_request_id(payload)
        if request_id is not None and self._core.knows_gateway(identity):
            self._core.outbox.to_gateway(
                identity,
                m.RequestError(
                    request_id, "INVALID_ARGUMENT", f"the scheduler could not read the request: {problem[:500]}"
                ),
            )

    async def _receive_workers(self) -> None:
        async for identity, message in _decoded(self._worker_socket, self._worker_codec, self._worker_errors):
            if not self._core.on_worker_message(identity, message, time.monotonic()):
                self._worker_errors.record("stale_or_unexpected", message=type(message).__name__)
            await self._flush()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(_TICK_S)
            for identity in self._core.gateways_to_probe():  # a closed connection is found here, or by any other send
                await self._send_to_gateway(identity, self._gateway_probe_frame, probe=True)
            self._core.check_timeouts(time.monotonic())
            await self._flush()

    async def _flush(self) -> None:
        outbox = self._core.outbox.take()
        # Workers first: a waiting worker is idle hardware, a waiting gateway is not.
        for item in sorted(outbox, key=lambda o: not o.to_worker):
            if not item.to_worker:
                await self._send_to_gateway(item.identity, self._gateway_codec.encode(item.message))
                continue
            try:
                await self._worker_socket.send_multipart([item.identity, self._worker_codec.encode(item.message)])
            except (
                zmq.ZMQError
            ) as exc:  # to a worker whose connection is gone (ROUTER_MANDATORY): its loss is found apart
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                log.info("worker.unreachable", message=type(item.message).__name__, identity=item.identity[:80])

    async def _send_to_gateway(self, identity: bytes, frame: bytes, *, probe: bool = False) -> None:
        """Never waits: a full queue drops the frame (counted; a probe that finds one full has its answer), a closed
        connection tells the core the gateway is missing."""
        try:
            await self._gateway_socket.send_multipart([identity, frame], flags=zmq.NOBLOCK)
        except zmq.Again:
            if not probe:
                self._gateway_errors.record("send_queue_full", identity=identity[:80], num_bytes=len(frame))
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._core.on_gateway_unreachable(identity, time.monotonic())


def _max_frame_bytes(config: SchedulerConfig) -> dict[Role, int]:
    """The largest frame each socket takes, from the scheduler's settings: the gateways' largest is a submitted request,
    the workers' a step's result (its target features the largest part) or a proposal."""
    k, threshold = config.num_speculative_tokens, config.spec_disable_batch_threshold
    limits = frames.FrameLimits(
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        # Caps not given are the draft's kind's (speculation_caps), known only at its hello: the largest allowed here.
        max_draft_tokens=m.MAX_DRAFT_TOKENS if k is None else min(k, m.MAX_DRAFT_TOKENS),
        max_propose_seqs=config.max_num_seqs if threshold is None else min(config.max_num_seqs, threshold),
        feature_width=m.MAX_FEATURE_WIDTH,
    )
    return {"gateway": frames.gateway_to_scheduler(config.max_model_len), "worker": frames.worker_to_scheduler(limits)}


def unreadable_request_id(payload: bytes) -> str | None:
    """The request id of a submit that does not decode as one, when it holds a readable one."""
    try:
        fields = msgspec.msgpack.decode(payload)
    except Exception:  # anything at all: this only looks for a name to answer to
        return None
    if not isinstance(fields, dict) or fields.get("type") != "submit":
        return None
    request_id = fields.get("request_id")
    return request_id if isinstance(request_id, str) and 0 < len(request_id) <= m.MAX_REQUEST_ID_CHARS else None


async def _decoded(
    socket: zmq.asyncio.Socket,
    codec: m.Codec[T],
    errors: ProtocolErrors,
    on_unreadable: Callable[[bytes, bytes, str], None] | None = None,
) -> AsyncIterator[tuple[bytes, T]]:
    """(sender identity, message) for every well-formed frame; anything else is counted and dropped (and told to
    `on_unreadable`, with the sender and the problem)."""
    while True:
        frames = await socket.recv_multipart()
        if len(frames) != 2:
            errors.record("frames", num_frames=len(frames))
            continue
        identity, payload = frames
        try:
            yield identity, codec.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            errors.record("decode", error=str(exc), num_bytes=len(payload))
            if on_unreadable is not None:
                on_unreadable(identity, payload, str(exc))
