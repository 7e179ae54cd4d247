"""What `specserve distill --resume` reuses: the data and checkpoints it saved,
read back only when made with the same arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class ResumeMismatch(ValueError):
    """--resume found data or a checkpoint made with other arguments."""


def load_saved(path: Path, wanted: dict[str, object], map_location: str = "cpu") -> dict[str, Any]:
    """What --resume reuses (data or a checkpoint); ResumeMismatch, naming each difference, unless it can be read and
    was made with the `wanted` arguments."""
    try:
        saved: dict[str, Any] = torch.load(path, weights_only=False, map_location=map_location)
    except Exception as error:  # noqa: BLE001 - a truncated or foreign file: say which, not a pickle trace
        raise ResumeMismatch(
            f"{path} cannot be read ({type(error).__name__}: {error}); delete it to start over"
        ) from error
    recorded = saved.get("arguments")
    if recorded != wanted:
        given = recorded if isinstance(recorded, dict) else {}
        differ = [
            f"{k}: {given.get(k)!r} there, {wanted.get(k)!r} now"
            for k in sorted(set(given) | set(wanted))
            if given.get(k) != wanted.get(k)
        ]
        raise ResumeMismatch(
            f"{path} was made with other arguments ({'; '.join(differ)}); run with them, or delete it to start over"
        )
    return saved


def save_checkpoint(path: Path, state: dict[str, object]) -> None:
    """`state` at `path`, written whole or not at all: saved beside it, then renamed over it."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
