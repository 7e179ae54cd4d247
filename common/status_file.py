"""A one-line file holding a process's lifecycle state, for container health checks."""

from __future__ import annotations

import os
from pathlib import Path


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
