"""Where a waiting request runs: the worker whose KV pages can take it, preferring its cached prefix.

A request is admitted by pages, not slots: its tokens' pages (less those its cached prefix
already holds) must be available with a watermark left over, so the running sequences
have room to grow before anyone must be preempted; and a worker runs at most
`max_num_seqs` sequences.

Among the workers that can take it, a request goes to the one holding the longest cached
prefix of its tokens (a hit skips that prefill, by far the dearest part of a request on a
CPU) unless that worker is much busier than the least busy one: more than
`BUSY_FACTOR` times its running sequences plus `BUSY_SLACK`. A prefix saves its prefill
once; a busy worker slows every step of the request, and of all the others it runs. Ties
(no hit anywhere, the usual case) go to the least busy worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.requests import Request
from scheduler.workers import WorkerRecord

BUSY_FACTOR = 2
BUSY_SLACK = 4
WATERMARK_SHARE = 0.01  # of a worker's pages kept available when admitting


@dataclass(frozen=True)
class Placement:
    worker: WorkerRecord
    num_cached_tokens: int


def watermark(num_pages: int) -> int:
    """Pages kept available when admitting (none in a pool of under 100)."""
    return int(num_pages * WATERMARK_SHARE)


def choose_worker(
    request: Request, workers: Sequence[WorkerRecord], max_num_seqs: int, *, share_prefix: bool = True
) -> Placement | None:
    """Admit the request's pages on the best worker that can take it now; None (admitting nothing) when none can.

    `share_prefix` False: no cached prefix is used (a draft head needs the target features of every position,
    which a cache hit would skip).
    """
    tokens = request.token_ids
    candidates: list[tuple[int, WorkerRecord]] = []  # (cached tokens, worker)
    for worker in workers:
        pool = worker.pages
        if pool is None or len(worker.requests) >= max_num_seqs:
            continue
        cached = len(pool.cached_prefix(tokens, request.cache_salt)) * pool.page_size if share_prefix else 0
        candidates.append((cached, worker))
    if not candidates:
        return None
    least = min(len(worker.requests) for _, worker in candidates)
    ordered = sorted(candidates, key=lambda c: (-c[0], len(c[1].requests)))
    for cached, worker in ordered:
        if cached and len(worker.requests) > BUSY_FACTOR * least + BUSY_SLACK:
            continue  # much busier: its prefix is not worth it (the least busy one comes later in the order)
        pool = worker.pages
        assert pool is not None
        hit = pool.admit(
            request.request_id, tokens, keep_free=watermark(pool.num_pages), share=share_prefix, salt=request.cache_salt
        )
        if hit is not None:
            return Placement(worker, hit)
    return None


def too_long_problem(request: Request, workers: Sequence[WorkerRecord]) -> str:
    """Why no worker's whole KV cache can ever hold the request's tokens ("" when one can, or none is READY)."""
    pools = [w.pages for w in workers if w.pages is not None]
    if not pools:
        return ""
    largest = max(pools, key=lambda pool: pool.num_pages)
    need = largest.pages_for(request.num_tokens)
    if need <= largest.num_pages:
        return ""
    return (
        f"the prompt ({len(request.prompt_token_ids)} tokens) needs {need} KV pages of {largest.page_size} positions; "
        f"the largest worker's KV cache holds {largest.num_pages} pages ({largest.num_pages * largest.page_size} "
        f"tokens: raise --kv-cache-memory)"
    )
