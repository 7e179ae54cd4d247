"""What a worker's or draft service's hello may claim: sizes, counts and names in range, an incarnation not from the
future. A hello beyond them is refused before a record (and its page pool) is built."""

from __future__ import annotations

from proto import messages as m

# What a hello may claim: anything beyond is refused before a record (and its page pool) is built.
MAX_PAGE_SIZE = 1024
MAX_SIZE = 1 << 24  # vocabulary, context length
MAX_FEATURE_WIDTH = m.MAX_FEATURE_WIDTH  # the protocol's limits (proto/messages.py), which size the frames
MAX_DRAFT_TOKENS = m.MAX_DRAFT_TOKENS
MAX_NAME_CHARS = m.MAX_NAME_CHARS
MAX_KERNELS_CHARS = m.MAX_KERNELS_CHARS
# Incarnations are the process's start time in ns (common/lifecycle_process.py): one from further ahead than
# this would outrank every honest restart for that long.
MAX_INCARNATION_AHEAD_NS = 24 * 3600 * 10**9


def hello_problem(hello: m.WorkerHello, now_ns: int) -> str:
    """Why a hello is not believable ("" when it is): sizes, counts and names out of range, an incarnation from the
    future."""
    if not 0 < hello.incarnation <= now_ns + MAX_INCARNATION_AHEAD_NS:
        return f"incarnation {hello.incarnation} is not a start time up to a day ahead of the scheduler's clock"
    ranges = {
        "num_kv_pages": (hello.num_kv_pages, 0, m.MAX_KV_PAGES),
        "kv_page_size": (hello.kv_page_size, 0, MAX_PAGE_SIZE),
        "vocab_size": (hello.vocab_size, 0, MAX_SIZE),
        "max_model_len": (hello.max_model_len, 0, MAX_SIZE),
        "feature_width": (hello.feature_width, 0, MAX_FEATURE_WIDTH),
        "max_draft_tokens": (hello.max_draft_tokens, 0, MAX_DRAFT_TOKENS),
        "pid": (hello.pid, 0, 1 << 32),
    }
    for name, (value, low, high) in ranges.items():
        if not low <= value <= high:
            return f"{name} {value} is outside {low} .. {high}"
    for name in m.HELLO_NAMES:
        if len(getattr(hello, name)) > MAX_NAME_CHARS:
            return f"{name} is longer than {MAX_NAME_CHARS} characters"
    return ""
