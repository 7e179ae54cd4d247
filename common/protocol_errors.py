"""Counts malformed or unexpected messages (exported in /metrics);
logs the first of each kind with context, then only counts."""

from __future__ import annotations

from collections import Counter

from common.logs import get_logger

log = get_logger()


class ProtocolErrors:
    def __init__(self, socket_name: str) -> None:
        self._socket_name = socket_name
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def record(self, kind: str, **context: object) -> None:
        """Count one dropped message of `kind` ("decode", "unknown_sender", ...)."""
        self.counts[kind] += 1
        if self.counts[kind] == 1:
            log.warning(
                "protocol.error",
                socket=self._socket_name,
                kind=kind,
                note="later ones of this kind are only counted",
                **context,
            )
