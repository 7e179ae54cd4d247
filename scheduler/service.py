"""The scheduler's asyncio shell: receive from gateways and workers, feed the core, send its outbox."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from typing import TypeVar

import msgspec
import zmq
import zmq.asyncio

from common.logs import get_logger
from common.protocol_errors import ProtocolErrors
from common.status_file import LISTENING, write_status_file
from proto import messages as m
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore

log = get_logger()

T = TypeVar("T")

_TICK_S = 0.05


class SchedulerService:
    def __init__(self, config: SchedulerConfig) -> None:
        self._config = config
        self._core = SchedulerCore(config)
        self._context = zmq.asyncio.Context()
        self._gateway_socket = self._context.socket(zmq.ROUTER)
        self._worker_socket = self._context.socket(zmq.ROUTER)
        self._gateway_codec: m.Codec[m.GatewayToScheduler] = m.Codec(m.GatewayToScheduler)
        self._worker_codec: m.Codec[m.WorkerToScheduler] = m.Codec(m.WorkerToScheduler)
        self._gateway_errors = self._core.protocol_errors["gateway"]
        self._worker_errors = self._core.protocol_errors["worker"]
        self._stop = asyncio.Event()

    async def run(self) -> None:
        for sock, address in ((self._gateway_socket, self._config.gateway_address), (self._worker_socket, self._config.worker_address)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted process may reuse its identity
            sock.bind(address)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._stop.set)
        if self._config.status_file is not None:
            write_status_file(self._config.status_file, LISTENING)
        log.info("scheduler.listening", gateway_address=self._config.gateway_address, worker_address=self._config.worker_address)
        try:
            async with asyncio.TaskGroup() as tasks:
                receivers = [
                    tasks.create_task(self._receive_gateways(), name="receive-gateways"),
                    tasks.create_task(self._receive_workers(), name="receive-workers"),
                    tasks.create_task(self._tick(), name="timeouts"),
                ]
                await self._stop.wait()
                for task in receivers:
                    task.cancel()
        finally:
            self._gateway_socket.close()
            self._worker_socket.close()
            self._context.term()
        log.info("scheduler.stopped")

    async def _receive_gateways(self) -> None:
        async for identity, message in _decoded(self._gateway_socket, self._gateway_codec, self._gateway_errors):
            if not isinstance(message, m.GatewayHello) and not self._core.knows_gateway(identity):
                self._gateway_errors.record("unknown_sender", message=type(message).__name__)
                continue
            self._core.on_gateway_message(identity, message, time.monotonic())
            await self._flush()

    async def _receive_workers(self) -> None:
        async for identity, message in _decoded(self._worker_socket, self._worker_codec, self._worker_errors):
            if not self._core.on_worker_message(identity, message, time.monotonic()):
                self._worker_errors.record("stale_or_unexpected", message=type(message).__name__)
            await self._flush()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(_TICK_S)
            self._core.check_timeouts(time.monotonic())
            await self._flush()

    async def _flush(self) -> None:
        outbox = self._core.outbox.take()
        # Workers first: a waiting worker is idle hardware, a waiting gateway is not.
        for item in sorted(outbox, key=lambda o: not o.to_worker):
            sock = self._worker_socket if item.to_worker else self._gateway_socket
            codec = self._worker_codec if item.to_worker else self._gateway_codec
            await sock.send_multipart([item.identity, codec.encode(item.message)])


async def _decoded(socket: zmq.asyncio.Socket, codec: m.Codec[T], errors: ProtocolErrors) -> AsyncIterator[tuple[bytes, T]]:
    """(sender identity, message) for every well-formed frame; anything else is counted and dropped."""
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
