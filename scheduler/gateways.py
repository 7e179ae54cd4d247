"""The gateways the scheduler knows: when each was last heard, and since when it has been missing.

A gateway is missing from the moment its connection is found closed (a message routed to
it has nowhere to go: the shell's probe every tick, or any other send) or once it has been
silent for the heartbeat timeout (a host that vanished without closing its connection, a
process that hangs). Any message brings it back. One missing for longer than the grace
window is gone: the registry forgets it and the core aborts its requests.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass

from common.logs import get_logger

log = get_logger()


class GatewayState(enum.Enum):
    CONNECTED = "connected"
    MISSING = "missing"  # its connection closed, or silent; it may still come back within the grace window


@dataclass
class GatewayRecord:
    identity: bytes  # the routing identity of its socket (a real gateway's: its --gateway-id)
    gateway_id: str  # as its hello said
    incarnation: str  # as its hello said: its process's
    last_seen_s: float  # when its last message came
    state: GatewayState = GatewayState.CONNECTED
    missing_since_s: float = 0.0  # while MISSING: since when
    missing_because: str = ""  # while MISSING: "disconnected" or "silent"


class GatewayRegistry:
    """Every gateway that said hello (or a heartbeat) and was not given up on since, by routing identity."""

    def __init__(self, heartbeat_timeout_s: float, grace_s: float) -> None:
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._grace_s = grace_s
        self._by_identity: dict[bytes, GatewayRecord] = {}

    def __contains__(self, identity: bytes) -> bool:
        return identity in self._by_identity

    def __len__(self) -> int:
        return len(self._by_identity)

    def __iter__(self) -> Iterator[GatewayRecord]:
        return iter(self._by_identity.values())

    def greet(self, identity: bytes, gateway_id: str, incarnation: str, now_s: float) -> GatewayRecord | None:
        """A hello or a heartbeat: the gateway is known from now on (again, after it was given up on). Returns the
        record of the process it replaces, forgotten now, when it is another process under the same identity."""
        record = self._by_identity.get(identity)
        if record is not None and record.incarnation != incarnation:
            del self._by_identity[identity]
            record.state, record.missing_because = GatewayState.MISSING, "restarted"
            record.missing_since_s = now_s
            replaced: GatewayRecord | None = record
        elif record is not None:
            record.gateway_id = gateway_id
            self.heard(identity, now_s)
            return None
        else:
            replaced = None
        self._by_identity[identity] = GatewayRecord(identity, gateway_id, incarnation, now_s)
        log.info("gateway.hello", gateway_id=gateway_id, identity=identity[:80], incarnation=incarnation)
        return replaced

    def heard(self, identity: bytes, now_s: float) -> None:
        """Any message from a known gateway: it is connected (again)."""
        record = self._by_identity.get(identity)
        if record is None:
            return
        record.last_seen_s = now_s
        if record.state is GatewayState.MISSING:
            log.info(
                "gateway.back",
                gateway_id=record.gateway_id,
                missing_because=record.missing_because,
                missing_for_s=round(now_s - record.missing_since_s, 3),
            )
            record.state = GatewayState.CONNECTED
            record.missing_because = ""

    def unreachable(self, identity: bytes, now_s: float) -> None:
        """A message routed to it found no connection: its connection closed (a crash, a kill, a network drop)."""
        record = self._by_identity.get(identity)
        if record is not None and record.state is GatewayState.CONNECTED:
            self._missing(record, now_s, "disconnected")

    def connected(self) -> list[bytes]:
        """The identities of the gateways believed connected: what the shell probes."""
        return [r.identity for r in self._by_identity.values() if r.state is GatewayState.CONNECTED]

    def gone(self, now_s: float) -> list[GatewayRecord]:
        """The gateways missing for longer than the grace window, forgotten now (silent ones are found missing
        first: from the moment their heartbeat was overdue)."""
        for record in self._by_identity.values():
            overdue_since_s = record.last_seen_s + self._heartbeat_timeout_s
            if record.state is GatewayState.CONNECTED and now_s > overdue_since_s:
                self._missing(record, overdue_since_s, "silent")
        gone = [
            r
            for r in self._by_identity.values()
            if r.state is GatewayState.MISSING and now_s - r.missing_since_s >= self._grace_s
        ]
        for record in gone:
            del self._by_identity[record.identity]
        return gone

    def _missing(self, record: GatewayRecord, since_s: float, because: str) -> None:
        record.state = GatewayState.MISSING
        record.missing_since_s = since_s
        record.missing_because = because
        log.warning(
            "gateway.missing",
            gateway_id=record.gateway_id,
            because=because,
            grace_s=self._grace_s,
            note="its requests run on; they are aborted unless it comes back within --gateway-gone-grace-s",
        )
