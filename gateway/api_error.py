"""ApiError: a request the HTTP routes refuse, written as OpenAI's error body with its HTTP status.

Every HTTP route raises it (OpenAI's, SGLang's, /tokenize, the body reader), so it sits
beneath them all; a RequestFailed from the shared path becomes one with `from_failure`.
"""

from __future__ import annotations

from typing import Any

import grpc

from gateway.errors import InvalidArgument, RequestFailed

HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.INTERNAL: 500,
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    500: "internal_error",
}


class ApiError(Exception):
    """A request the HTTP API refuses, as OpenAI's error body says it: status, message, the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "error"),
                "param": self.param,
                "code": self.code,
            }
        }

    @classmethod
    def from_failure(cls, failure: RequestFailed) -> ApiError:
        param = failure.field if isinstance(failure, InvalidArgument) else None
        return cls(HTTP_STATUS.get(failure.status, 500), failure.message, param)
