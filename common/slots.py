"""Worker ids that need no hand editing, for copies of one container (`docker compose` replicas).

`--worker-id 'cpu-{slot}' --slot-dir DIR`: the process takes the lowest slot number that no
live process holds, holding it by a lock on `DIR/N.lock` until it ends (the kernel drops the
lock with the process, however it ends). Copies that share DIR get distinct ids, and one that
restarts after a crash gets its old id back while the others hold theirs. `--device
cuda:{slot}` gives the process only its slot's GPU: `CUDA_VISIBLE_DEVICES` is narrowed to that
one device (the slot-th of those visible) and the process runs on cuda:0.
"""

from __future__ import annotations

import argparse
import fcntl
import os
from pathlib import Path
from typing import IO

SLOT = "{slot}"
_held: list[IO[str]] = []  # the open lock files: a slot is held as long as its file stays open


def claim(folder: Path) -> int:
    """The lowest slot in `folder` that no live process holds, now held by this one."""
    folder.mkdir(parents=True, exist_ok=True)
    slot = 0
    while True:
        lock = open(folder / f"{slot}.lock", "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            slot += 1
            continue
        _held.append(lock)
        return slot


def apply(args: argparse.Namespace) -> None:
    """Put this process's slot into args.worker_id (and args.device); raises ValueError naming the setting."""
    if SLOT not in args.worker_id and SLOT not in args.device:
        return
    if args.slot_dir is None:
        raise ValueError(f"--worker-id or --device with {SLOT} needs --slot-dir (a folder shared by the copies)")
    if SLOT in args.device and args.device != f"cuda:{SLOT}":
        raise ValueError(f"--device takes {SLOT} only as cuda:{SLOT}, got {args.device!r}")
    slot = claim(args.slot_dir)
    args.worker_id = args.worker_id.replace(SLOT, str(slot))
    if args.device == f"cuda:{SLOT}":
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        if visible and slot >= len(visible):
            raise ValueError(
                f"--device cuda:{SLOT}: slot {slot}, but CUDA_VISIBLE_DEVICES names {len(visible)} devices"
            )
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[slot] if visible else str(slot)
        args.device = "cuda:0"
