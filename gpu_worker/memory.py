"""How many KV pages a worker's memory budget buys."""

from __future__ import annotations

from pathlib import Path

import torch

from gpu_worker.config import WorkerConfig
from modeling.model.config import ModelConfig
from modeling.model.graphs import graph_capacity_pages, graph_pool_estimate_bytes
from modeling.model.kv_cache import page_bytes, pages_for
from proto import messages as m

GIB = 1024**3
CPU_SHARE = 0.25  # of the memory available at start, by default
CUDA_SHARE = 0.5  # of the device memory free at start (the weights not yet loaded), by default


MIN_POSITIONS = 64  # a cache holding fewer positions is a mistake, not a budget


class MemoryBudgetError(ValueError):
    """The budget buys too few pages to serve anything."""


def available_memory_bytes(device: str) -> int:
    """Memory free for new allocations now: the kernel's MemAvailable on CPU, the device's free memory on CUDA."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")


def kv_cache_budget_bytes(config: WorkerConfig, model: ModelConfig) -> tuple[int, str]:
    """(the KV cache's bytes, how they were decided: for the log)."""
    if config.kv_cache_memory_gib is not None:
        return int(config.kv_cache_memory_gib * GIB), f"--kv-cache-memory {config.kv_cache_memory_gib:g} GiB"
    device = config.process.device
    share = CUDA_SHARE if device.startswith("cuda") else CPU_SHARE
    budget = int(available_memory_bytes(device) * share)
    why = f"{share:.0%} of the memory available on {device} at start"
    dtype: torch.dtype = getattr(torch, config.process.dtype)
    if config.cuda_graphs != "off" and device.startswith("cuda"):  # the graphs' pool comes out of the same share
        capacity = graph_capacity_pages(config.max_model_len, config.page_size) * config.page_size
        reserve = graph_pool_estimate_bytes(model, config.max_num_seqs, config.max_draft_tokens + 1, capacity, dtype)
        budget, why = max(0, budget - reserve), f"{why}, less {reserve / GIB:.2f} GiB for the CUDA graphs' pool"
    most = (
        config.max_num_seqs
        * pages_for(config.max_model_len, config.page_size)
        * page_bytes(model, config.page_size, dtype)
    )
    if budget > most:
        return most, f"what {config.max_num_seqs} sequences of {config.max_model_len} tokens need (--max-num-seqs)"
    return budget, why


def num_kv_pages(config: WorkerConfig, model: ModelConfig) -> tuple[int, str]:
    """(pages, how their budget was decided); raises MemoryBudgetError when they hold fewer than MIN_POSITIONS.

    A pool smaller than one sequence of max_model_len serves: a prompt it cannot hold is refused, naming the limit.
    """
    budget, why = kv_cache_budget_bytes(config, model)
    per_page = page_bytes(model, config.page_size, getattr(torch, config.process.dtype))
    pages = budget // per_page - (config.cuda_graphs != "off")  # graphs' padding rows take a scratch page
    if pages > m.MAX_KV_PAGES:
        pages, why = m.MAX_KV_PAGES, f"{why}, capped at the protocol's {m.MAX_KV_PAGES} pages"
    if pages * config.page_size < MIN_POSITIONS:
        raise MemoryBudgetError(
            f"the KV cache budget of {budget / GIB:.4f} GiB ({why}) holds {pages} pages "
            f"of {config.page_size} positions "
            f"({per_page} bytes each): fewer than {MIN_POSITIONS} positions"
        )
    return pages, why
