"""Give freed memory back to the system at once: glibc's allocator, told not to keep large blocks.

glibc serves a block of 128 KiB or more from mmap and unmaps it when it is freed, but the
first time it frees one it raises that threshold to the block's size (up to 32 MiB) and
keeps later blocks of that size in its heap, which it seldom gives back. A gateway that
once read a 30 MiB body would so keep tens of MiB for every such body it reads. A fixed
threshold turns the adjustment off: every large block is unmapped as soon as it is freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 256 * 1024  # blocks this large or larger are mapped apart, and unmapped when freed


def return_freed_memory() -> bool:
    """Fix the allocator's mmap threshold; False where the C library is not glibc (nothing is changed there)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
