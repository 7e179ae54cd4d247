"""Which web pages' scripts may call the HTTP API from a browser: `--allowed-origins` (CORS).

Without it no answer carries CORS headers, so a browser lets no other origin's script read
one. With it, an answer to a request from an allowed origin (`*`: any) says that origin may
read it, and a browser's preflight (`OPTIONS` with `Access-Control-Request-Method`) from one
is answered here, before any key is asked for (a preflight carries none): the methods the API
serves and the headers a client may send, among them `Authorization` for the API key. A
preflight from an origin not allowed gets 403 and no CORS headers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web

ANY = "*"
METHODS = "GET, POST, OPTIONS"
HEADERS = "Authorization, Content-Type"
MAX_AGE_S = 600  # how long a browser may keep a preflight's answer


class OriginError(ValueError):
    """An --allowed-origins entry that is not an origin."""


def origin_problem(origin: str) -> str:
    """Why `origin` is not an origin a browser sends (scheme://host[:port]), "" when it is (or is `*`)."""
    if origin == ANY:
        return ""
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path or parts.query or parts.fragment:
        return f"{origin!r} is not an origin: scheme://host[:port], as a browser sends it (or * for any)"
    return ""


@dataclass(frozen=True)
class Cors:
    """The origins whose scripts may read answers; empty: none (no CORS headers at all)."""

    origins: frozenset[str] = frozenset()

    @classmethod
    def of(cls, origins: Iterable[str]) -> Cors:
        entries = [part.strip().rstrip("/") for given in origins for part in given.split(",") if part.strip()]
        for entry in entries:
            if problem := origin_problem(entry):
                raise OriginError(f"--allowed-origins: {problem}")
        return cls(frozenset(entries))

    def allows(self, origin: str | None) -> bool:
        return origin is not None and (ANY in self.origins or origin in self.origins)

    @web.middleware
    async def preflight(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """A browser's preflight, answered here (before any key is asked for); every other request passes on."""
        if not (self.origins and request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers):
            return await handler(request)
        origin = request.headers.get("Origin")
        if not self.allows(origin):
            return web.Response(status=403, text="this origin may not call this API\n")
        answer = web.Response(status=204)
        answer.headers["Access-Control-Allow-Methods"] = METHODS
        answer.headers["Access-Control-Allow-Headers"] = HEADERS
        answer.headers["Access-Control-Max-Age"] = str(MAX_AGE_S)
        return answer

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every answer's headers as they are sent (a stream's included, which starts before its handler returns):
        an allowed origin is told it may read it."""
        origin = request.headers.get("Origin")
        if self.allows(origin):
            response.headers["Access-Control-Allow-Origin"] = ANY if ANY in self.origins else str(origin)
            if ANY not in self.origins:
                response.headers["Vary"] = "Origin"
