"""A one-line file holding what a process can do now, for container health checks.

A worker or the draft service writes its lifecycle state (proto.lifecycle.State); the
scheduler, which has no lifecycle, writes LISTENING once its sockets are bound.
"""

from __future__ import annotations

import os
from pathlib import Path

from proto.lifecycle import State

LISTENING = "LISTENING"  # the scheduler's only status
HEALTHY = frozenset({State.READY.value, LISTENING})  # what a health check accepts: a READY process, a listening scheduler


def write_status_file(path: Path, state: str) -> None:
    """Replace the file atomically, so a reader never sees half a state."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(state + "\n")
    os.replace(temporary, path)


def read_status_file(path: Path) -> str:
    """The state written last, or "" when there is no file yet."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""
