"""A small file holding what a process can do now, for container health checks.

A worker or the draft service writes its lifecycle state (proto.lifecycle.State); the
scheduler, which has no lifecycle, writes LISTENING once its sockets are bound. The file
also names its writer (pid and start time), and a reader believes it only while that very
process is alive: a file left behind by a process that was killed, or by the earlier run
of a restarted container (whose new process has the same pid, 1, but a later start time),
says nothing about now.
"""

from __future__ import annotations

import os
from pathlib import Path

from proto.lifecycle import State

LISTENING = "LISTENING"  # the scheduler's only status
HEALTHY = frozenset(
    {State.READY.value, LISTENING}
)  # what a health check accepts: a READY process, a listening scheduler


def _started(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat, field 22);
    None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: count fields after the last ")".
    return stat[stat.rindex(")") + 2 :].split()[19]


def write_status_file(path: Path, state: str) -> None:
    """Replace the file atomically, so a reader never sees half a state."""
    pid = os.getpid()
    temporary = path.with_name(f".{path.name}.{pid}")
    temporary.write_text(f"{state}\n{pid} {_started(pid)}\n")
    os.replace(temporary, path)


def read_status_file(path: Path) -> str:
    """The state written last, or "" when there is no file yet, the file names no writer, or its writer has ended."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return ""
    if len(lines) != 2 or len(writer := lines[1].split()) != 2 or not writer[0].isdigit():
        return ""
    pid, started = writer
    return lines[0].strip() if _started(int(pid)) == started else ""
