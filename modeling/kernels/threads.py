"""The threads a process computes on, shared by the native kernels' team.

A process computes on the cores it may use (common/cpus.py) unless told otherwise. The
native kernels share each call among a team (csrc/team.h) that never waits for a thread
the OS has not run, so a core taken by another process for a while slows a step by the
share that core would have done, not by a scheduler's time slice at every call. Torch's
own ops keep one thread where the native kernels serve: each of their parallel regions
ends in a barrier that waits for every thread, the failure the team exists to avoid.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from modeling.kernels.native import KernelUnavailable, native_ops


def compute_on(num_threads: int, native: bool) -> None:
    """Computes on `num_threads` threads from now on: the native kernels' team when the model runs on them (torch's
    ops then on one thread), else torch's own threads."""
    if num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, not {num_threads}")
    if native:
        native_ops().set_num_threads(num_threads)
        torch.set_num_threads(1)
    else:
        torch.set_num_threads(num_threads)


def compute_threads() -> int:
    """The threads the native kernels share a call among (torch's own where they cannot be built)."""
    try:
        return int(native_ops().get_num_threads())
    except KernelUnavailable:
        return torch.get_num_threads()


@contextmanager
def one_thread() -> Iterator[None]:
    """Everything on the calling thread alone (the native kernels and torch's ops), as it was after."""
    torch_threads = torch.get_num_threads()
    try:
        ops = native_ops()
    except KernelUnavailable:
        ops = None
    team_threads = int(ops.get_num_threads()) if ops is not None else 1
    torch.set_num_threads(1)
    if ops is not None:
        ops.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(torch_threads)
        if ops is not None:
            ops.set_num_threads(team_threads)
