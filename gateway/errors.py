"""The gateway's error taxonomy: expected request failures with a gRPC status, and fatal start-up errors."""

from __future__ import annotations

import grpc

from proto import messages

# How the scheduler's error codes reach the client.
SCHEDULER_CODE_TO_STATUS: dict[messages.ErrorCode, grpc.StatusCode] = {
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "INTERNAL": grpc.StatusCode.INTERNAL,
}


class RequestFailed(Exception):
    """Expected: one request cannot go on; `status` and `message` are what the client sees."""

    def __init__(self, status: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message

    @classmethod
    def from_scheduler(cls, error: messages.RequestError) -> RequestFailed:
        return cls(SCHEDULER_CODE_TO_STATUS[error.code], error.message)


class InvalidArgument(RequestFailed):
    """The request itself is wrong; the message names the field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")
        self.field = field


class SchedulerUnavailable(RequestFailed):
    """The scheduler did not answer in time; the message names the address and the setting."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


class UnreadableRequest(RequestFailed):
    """A bug in the gateway's checks: it built a request the scheduler could not read. Nothing is sent (the scheduler
    would drop it unanswered, and the client would wait for ever); the request fails with INTERNAL."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.INTERNAL, message)


class StartupError(Exception):
    """Fatal: the gateway cannot start (bad model folder, port in use, ...); it exits non-zero."""
