"""One region of memory for a model's large weights, in 2 MiB pages where the kernel gives them.

A core reads a stream of weights from huge pages faster than from 4 KiB ones: one TLB entry
for 2 MiB, and the hardware prefetcher is not stopped at every 4 KiB boundary. Measured on an
AMD EPYC (docs/benchmarks.md): GGUF blocks at one row 0.86-0.90 of the time, bfloat16 decode
steps 0.89-0.99 at 1-16 rows. Transparent huge pages set to `madvise` (a common default) give
them only to memory that asks, so a model's weights are placed in one region that asks.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

_PAGE, _HUGE_PAGE = 4096, 2 << 20


class HugePageRegion:
    """Places for tensors of known sizes, each at a page boundary, one after another in the order asked for.

    Memory is committed as places are written, not when the region is made, so a place never
    written (a weight served from another copy) costs nothing but address space. Where the
    kernel has no huge pages the region is plain memory; where the tensors are not on the CPU,
    or the kernel refuses that much address space at once (a large model's dense weights,
    served from its GGUF blocks on a machine with less memory than they would take), there is
    no region, and `empty` and `take` give ordinary tensors.
    """

    def __init__(self, sizes: Sequence[int], device: torch.device = torch.device("cpu")) -> None:
        """A region for tensors of `sizes` bytes on `device` (none for an empty list or another device)."""
        self._device = device
        self._map: mmap.mmap | None = None
        self._memory: torch.Tensor | None = None
        self._next = 0
        total = sum(_place_size(size) for size in sizes)
        if not total or device.type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE"):
            return
        try:
            region = mmap.mmap(-1, total + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError:  # more address space at once than the kernel's overcommit allows: tensors one by one
            return
        memory = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` as long as any tensor in it lives
        self._start = -memory.data_ptr() % _HUGE_PAGE
        try:
            region.madvise(mmap.MADV_HUGEPAGE, self._start, total)
        except OSError:  # a kernel without transparent huge pages: plain pages, in the same order
            pass
        self._map = region
        self._memory = memory[self._start : self._start + total]

    @classmethod
    def holding(cls, weights: Sequence[torch.Tensor]) -> HugePageRegion:
        """A region for copies of `weights` (`take`), or none where any of them is not on the CPU."""
        on_cpu = all(weight.device.type == "cpu" for weight in weights)
        return cls([weight.numel() * weight.element_size() for weight in weights] if on_cpu else [])

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor in the region's next place; a plain one on the region's device where it has no
        place (off the CPU, or full)."""
        place = self._place(math.prod(shape) * dtype.itemsize)
        if place is None:
            return torch.empty(tuple(shape), dtype=dtype, device=self._device)
        return place.view(dtype).view(tuple(shape))

    def take(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` copied into the region's next place, or itself where there is no place for it."""
        place = self._place(weight.numel() * weight.element_size())
        if place is None:
            return weight
        moved = place.view(weight.dtype).view(weight.shape)
        moved.copy_(weight)
        return moved

    def release(self, tensor: torch.Tensor) -> None:
        """Give the pages of the place `tensor` fills back to the kernel: it is no longer read (a weight replaced by
        another copy). A tensor not in the region is left alone; the place stays the region's, zeros if read."""
        if self._memory is None or self._map is None:
            return
        offset = tensor.data_ptr() - self._memory.data_ptr()
        if offset < 0 or offset % _PAGE or offset >= self._memory.numel():
            return
        length = min(_place_size(tensor.numel() * tensor.element_size()), self._memory.numel() - offset)
        self._map.madvise(mmap.MADV_DONTNEED, self._start + offset, length)

    def _place(self, nbytes: int) -> torch.Tensor | None:
        if self._memory is None or self._next + nbytes > self._memory.numel():
            return None
        place = self._memory[self._next : self._next + nbytes]
        self._next += _place_size(nbytes)
        return place


def _place_size(nbytes: int) -> int:
    """The bytes a tensor of `nbytes` takes in a region: its own, up to a whole number of pages."""
    return -(-nbytes // _PAGE) * _PAGE
