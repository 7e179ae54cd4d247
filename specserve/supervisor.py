"""Runs the stack's processes, restarts a crashed one with backoff, and stops them all on a signal.

Children run in their own sessions, so a terminal's Ctrl-C reaches only the supervisor,
which then stops the gateway first (it drains its streams), then the workers and the
scheduler. Each child also gets SIGTERM if the supervisor itself dies (PR_SET_PDEATHSIG),
so no process outlives it.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from common.logs import get_logger

log = get_logger()

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    argv: list[str]
    stop_order: int  # lower stops first
    # False: past the restart limit it stays down and the rest go on (a target worker, the draft service): the stack
    # serves degraded and says so (/ready, GetServerInfo) rather than stopping every service for one.
    essential: bool = True


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_restarts: int = 5  # within `window_s`; one more and the supervisor gives up
    window_s: float = 300.0


@dataclass
class _Child:
    spec: ServiceSpec
    process: subprocess.Popen[bytes]
    restarts_s: list[float] = field(default_factory=list)
    restart_at_s: float | None = None
    given_up: bool = False


class GaveUp(RuntimeError):
    """A service kept crashing past the restart limit."""


class Supervisor:
    def __init__(self, specs: list[ServiceSpec], policy: RestartPolicy) -> None:
        self._specs = specs
        self._policy = policy
        self._children: dict[str, _Child] = {}
        self._stop = threading.Event()
        self._num_signals = 0

    def install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM stop the watch; a second one kills every child at once."""
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def start(self) -> None:
        for spec in self._specs:
            self._children[spec.name] = _Child(spec, _spawn(spec))

    def pids(self) -> dict[str, int]:
        return {name: child.process.pid for name, child in self._children.items()}

    def watch(self, until: Callable[[], bool] | None = None, poll_s: float = 0.2) -> None:
        """Restart crashed children until a signal arrives (or `until()` is true); raises GaveUp."""
        while not self._stop.is_set() and not (until and until()):
            now = time.monotonic()
            for child in self._children.values():
                self._check(child, now)
            time.sleep(poll_s)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self, grace_s: float) -> None:
        """SIGTERM every child in stop order, waiting up to `grace_s` each; SIGKILL what remains."""
        self._stop.set()
        for child in sorted(self._children.values(), key=lambda c: c.spec.stop_order):
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
                try:
                    child.process.wait(grace_s)
                except subprocess.TimeoutExpired:
                    log.warning("supervisor.kill", service=child.spec.name, grace_s=grace_s)
                    child.process.kill()
                    child.process.wait()
            log.info("supervisor.stopped", service=child.spec.name, returncode=child.process.returncode)

    def _check(self, child: _Child, now_s: float) -> None:
        if child.given_up:
            return
        if child.restart_at_s is not None:
            if now_s >= child.restart_at_s:
                child.restart_at_s = None
                child.process = _spawn(child.spec)
                log.info("supervisor.restarted", service=child.spec.name, pid=child.process.pid)
            return
        returncode = child.process.poll()
        if returncode is None:
            return
        child.restarts_s = [t for t in child.restarts_s if now_s - t < self._policy.window_s] + [now_s]
        if len(child.restarts_s) > self._policy.max_restarts:
            reason = (
                f"{child.spec.name} exited {len(child.restarts_s)} times in {self._policy.window_s:.0f} s "
                f"(last status {returncode})"
            )
            if child.spec.essential:
                raise GaveUp(reason)
            child.given_up = True
            log.error(
                "supervisor.gave_up", service=child.spec.name, reason=reason, note="the other services go on without it"
            )
            return
        # The first exit in the window is restarted at once (a stream waiting for its scheduler should not wait for
        # a backoff meant for crash loops); then 1x, 2x, 4x ... the initial backoff.
        exits = len(child.restarts_s)
        backoff_s = (
            0.0 if exits == 1 else min(self._policy.initial_backoff_s * 2 ** (exits - 2), self._policy.max_backoff_s)
        )
        child.restart_at_s = now_s + backoff_s
        log.warning("supervisor.exited", service=child.spec.name, returncode=returncode, restart_in_s=backoff_s)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._num_signals += 1
        self._stop.set()
        if self._num_signals > 1:  # a second Ctrl-C: no more waiting
            for child in self._children.values():
                if child.process.poll() is None:
                    child.process.kill()
            raise SystemExit(130)


def _spawn(spec: ServiceSpec) -> subprocess.Popen[bytes]:
    log.info("supervisor.spawn", service=spec.name, argv=" ".join(spec.argv))
    return subprocess.Popen(spec.argv, start_new_session=True, preexec_fn=_die_with_parent)


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
