"""A `specserve up` child process for a benchmark: started in its own session, stopped with SIGINT, checked for leftovers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

READY_LINE_PREFIX = "specserve ready"
# "specserve ready: gRPC on 127.0.0.1:50051, model NAME (float32, 1 worker(s) on cpu)"
_READY_LINE = re.compile(r"model (?P<model>\S+) \((?P<dtype>\w+), (?P<num_workers>\d+) worker\(s\) on (?P<device>\S+)\)")
_POLL_S = 0.2
_LOG_TAIL_CHARS = 3000


class StackError(RuntimeError):
    """The stack did not start, or did not stop cleanly; the message says which and why."""


@dataclass(frozen=True)
class StackOptions:
    specserve: Path  # the `specserve` executable
    port: int
    model: Path | None = None  # None: the stack's default model
    dtype: str | None = None  # None: the stack picks the faster one
    num_workers: int | None = None
    num_kv_slots: int | None = None
    ready_timeout_s: float = 600.0
    stop_timeout_s: float = 90.0
    extra_args: tuple[str, ...] = ()
    http_port: int = 8000  # more `specserve up` options (--draft, --num-speculative-tokens, ...)

    def argv(self) -> list[str]:
        optional = {"--model": self.model, "--dtype": self.dtype, "--num-workers": self.num_workers,
                    "--num-kv-slots": self.num_kv_slots}
        given = [part for flag, value in optional.items() if value is not None for part in (flag, str(value))]
        return [str(self.specserve), "up", "--host", "127.0.0.1", "--port", str(self.port), "--http-port", str(self.http_port),
                *given, *self.extra_args]


@dataclass(frozen=True)
class ReadyStack:
    address: str  # HOST:PORT of the gateway
    ready_line: str
    dtype: str | None  # as the ready line states it
    device: str | None
    log_path: Path  # the stack's stdout and stderr


@contextmanager
def running_stack(options: StackOptions) -> Iterator[ReadyStack]:
    """Start `specserve up`, yield once it says it is ready, and always stop it (SIGINT) on the way out."""
    log_fd, log_name = tempfile.mkstemp(prefix="specserve-bench-", suffix=".log")
    log_path = Path(log_name)
    with os.fdopen(log_fd, "wb") as log:
        # A new session: a Ctrl-C in the terminal reaches only the benchmark, which then stops the stack itself.
        process = subprocess.Popen(options.argv(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ready_line = _wait_ready(process, log_path, options.ready_timeout_s)
        match = _READY_LINE.search(ready_line)
        yield ReadyStack(address=f"127.0.0.1:{options.port}", ready_line=ready_line,
                         dtype=match["dtype"] if match else None, device=match["device"] if match else None,
                         log_path=log_path)
    finally:
        _stop(process, log_path, options.stop_timeout_s)


def _wait_ready(process: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> str:
    deadline_s = time.monotonic() + timeout_s
    while True:
        ready_line = _find_ready_line(log_path)
        if ready_line is not None:
            return ready_line
        if process.poll() is not None:
            raise StackError(f"`specserve up` exited with {process.returncode} before it was ready; "
                             f"its log ({log_path}) ends:\n{_log_tail(log_path)}")
        if time.monotonic() > deadline_s:
            raise StackError(f"`specserve up` was not ready after {timeout_s:.0f} s (raise --ready-timeout-s); "
                             f"its log ({log_path}) ends:\n{_log_tail(log_path)}")
        time.sleep(_POLL_S)


def _find_ready_line(log_path: Path) -> str | None:
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith(READY_LINE_PREFIX):
            return line
    return None


def _stop(process: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> None:
    """SIGINT, as a terminal's Ctrl-C; then every process the stack had started must be gone."""
    descendant_pids = _descendant_pids(process.pid)
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            _kill(descendant_pids)
            raise StackError(f"`specserve up` did not stop within {timeout_s:.0f} s of SIGINT and was killed; "
                             f"its log: {log_path}") from None
    left_pids = [pid for pid in descendant_pids if _is_running(pid)]
    if left_pids:
        _kill(left_pids)
        raise StackError(f"`specserve up` exited but left processes {left_pids} running (now killed); its log: {log_path}")


def _descendant_pids(root_pid: int) -> list[int]:
    """Every live process below root_pid, found through the parent pids in /proc."""
    children: dict[int, list[int]] = {}
    for pid, parent_pid in _parent_pids().items():
        children.setdefault(parent_pid, []).append(pid)
    found: list[int] = []
    pending = [root_pid]
    while pending:
        below = children.get(pending.pop(), [])
        found.extend(below)
        pending.extend(below)
    return found


def _parent_pids() -> dict[int, int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        stat = _read_stat(entry.name)
        if stat is not None:
            parents[int(entry.name)] = int(stat[1])
    return parents


def _read_stat(pid: str) -> list[str] | None:
    """/proc/PID/stat after the command name: [state, ppid, ...]; None for a vanished or non-process entry."""
    if not pid.isdigit():
        return None
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rpartition(")")[2].split()


def _is_running(pid: int) -> bool:
    stat = _read_stat(str(pid))
    return stat is not None and stat[0] != "Z"  # a zombie has exited; only its parent's wait is pending


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _log_tail(log_path: Path) -> str:
    return log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
