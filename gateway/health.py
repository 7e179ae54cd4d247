"""The standard gRPC health service, SERVING only while the scheduler reports a READY target worker."""

from __future__ import annotations

import asyncio
from typing import Protocol, TypeAlias

from grpc_health.v1 import health, health_pb2

from common.logs import get_logger
from gateway.errors import SchedulerUnavailable
from proto import messages
from proto.lifecycle import State

SERVICE_NAMES = ("", "specserve.v1.SpecServe")  # "" is the server as a whole

ServingStatus: TypeAlias = health_pb2.HealthCheckResponse.ServingStatus
SERVING: ServingStatus = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING: ServingStatus = health_pb2.HealthCheckResponse.NOT_SERVING


class InfoSource(Protocol):
    async def query_info(self) -> messages.InfoReply: ...


def serving_status(reply: messages.InfoReply | None) -> ServingStatus:
    """SERVING iff the scheduler answered and lists a target process in state READY."""
    if reply is None:
        return NOT_SERVING
    ready = any(process.role == "target" and process.state == State.READY for process in reply.processes)
    return SERVING if ready else NOT_SERVING


class HealthReporter:
    """Polls the scheduler every poll_interval_s and sets the health servicer's status for every service name.

    An unanswered query (the source raises SchedulerUnavailable after its own timeout)
    counts as NOT_SERVING. After `enter_shutdown()` the status stays NOT_SERVING.
    """

    def __init__(self, servicer: health.aio.HealthServicer, source: InfoSource, *, poll_interval_s: float) -> None:
        self.servicer = servicer
        self._source = source
        self._poll_interval_s = poll_interval_s
        self._status: ServingStatus | None = None
        self._shutting_down = False
        self._log = get_logger(component="health")

    @property
    def status(self) -> ServingStatus:
        """SERVING only after an answer listing a READY target, and never once shutting down."""
        return NOT_SERVING if self._shutting_down or self._status is None else self._status

    async def start(self) -> None:
        """NOT_SERVING for every service until the first answer (the servicer starts out SERVING)."""
        await self._set(NOT_SERVING, reason="starting")

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            await self.poll_once()
            await asyncio.sleep(self._poll_interval_s)

    async def poll_once(self) -> ServingStatus:
        try:
            reply: messages.InfoReply | None = await self._source.query_info()
            reason = "scheduler_answered"
        except SchedulerUnavailable as error:
            reply, reason = None, error.message
        status = serving_status(reply)
        await self._set(status, reason=reason)
        return status

    async def enter_shutdown(self) -> None:
        """NOT_SERVING for good: the server is draining."""
        self._shutting_down = True
        await self.servicer.enter_graceful_shutdown()
        self._log.info("health.changed", status="NOT_SERVING", reason="shutting_down")

    async def _set(self, status: ServingStatus, *, reason: str) -> None:
        for service in SERVICE_NAMES:
            await self.servicer.set(service, status)
        if status != self._status:
            self._log.info("health.changed", status=ServingStatus.Name(status), reason=reason)
            self._status = status
