"""The KV cache: one pool of fixed-size pages holding the keys and values of every layer.

A sequence's positions lie in the pages of its block table, in order: position p in page
`table[p // page_size]` at offset `p % page_size`. Which page holds what is the owner's
business (the scheduler's for a target worker, the proposer's in the draft service); the
cache itself is just memory, and every step names the pages it reads and writes.
"""

from __future__ import annotations

import math

import torch

from common.defaults import KV_PAGE_SIZE

from modeling.kernels.huge_pages import HugePageRegion
from modeling.model.config import ModelConfig

# Positions per page, vLLM's default too: a page of one kv head (2-4 KiB) is read straight
# through by the attention kernel, and a sequence wastes at most 15 positions. Against
# whole-sequence slots, serving throughput is unchanged (docs/benchmarks.md).
DEFAULT_PAGE_SIZE = KV_PAGE_SIZE


class KVCache:
    """Layout `[num_layers, num_pages, num_kv_heads, page_size, head_dim]`: one page of one
    layer and kv head is `page_size` consecutive rows, read straight through by attention.

    On the CPU keys and values lie in huge pages (modeling/kernels/huge_pages.py): a step reads a few
    KiB from each of thousands of pages scattered over the cache, and with 4 KiB pages nearly
    every one is a TLB miss (attention takes about a tenth less time in huge pages:
    docs/benchmarks.md).
    """

    def __init__(
        self, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (config.num_layers, num_pages, config.num_kv_heads, page_size, config.head_dim)
        nbytes = math.prod(shape) * dtype.itemsize
        memory = HugePageRegion([nbytes, nbytes], torch.device(device))
        self.keys = memory.empty(shape, dtype).zero_()
        self.values = memory.empty(shape, dtype).zero_()
        self.num_pages = num_pages
        self.page_size = page_size


def page_bytes(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """The memory one page takes: keys and values of every layer."""
    return 2 * config.num_layers * config.num_kv_heads * page_size * config.head_dim * dtype.itemsize


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def pages_for_slots(num_slots: int, max_len: int, page_size: int = DEFAULT_PAGE_SIZE) -> int:
    """The pages `num_slots` whole sequences of `max_len` positions take (see `slot_pages`)."""
    return num_slots * pages_for(max_len, page_size)


def slot_pages(slot: int, max_len: int, page_size: int = DEFAULT_PAGE_SIZE) -> tuple[int, ...]:
    """The block table of fixed slot `slot`, for tools that hold a few whole sequences of `max_len` positions
    at once over `pages_for_slots(num_slots, max_len)` pages: slot s holds pages s*n .. (s+1)*n-1."""
    per_slot = pages_for(max_len, page_size)
    return tuple(range(slot * per_slot, (slot + 1) * per_slot))
