"""Decode and verify steps replayed from captured graphs: on CUDA, one launch for a whole step.

At this model size a decode step on a GPU is mostly kernel launches. A CUDA graph records a
step's kernels once and replays them with one launch, but only at the shapes and addresses it
was captured with. So a graph is captured per bucket of shapes (`GraphShape`): R sequences
(1, 2, 4 ... 256, up to the worker's --max-num-seqs) of T new tokens each (1 for a decode
step, up to k + 1 for a verify step), every input in a static buffer the step's values are
copied into, every block table padded to a fixed capacity. Padding is harmless by
construction: a padding row reads and writes only the scratch page, one page past those the
scheduler is told of, and its outputs are never read. Attention is masked per row on the
device from each row's last attended position and a token tree's extra keys, so a tree fits
the same graph as a chain. A step that fits no bucket runs eagerly: prefill chunks, prompt
log-probabilities, more sequences than the largest bucket, a block table past the capacity,
and a token tree in a model with sliding windows.

Capture and replay sit behind `GraphBackend`: `CudaGraphBackend` on CUDA (graphs sharing one
memory pool), `RecordingBackend` elsewhere, which records each capture and replays through
the same static-buffer forward eagerly, so that bucket choice, padding and the fallbacks are
tested on a CPU.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from common.trees import is_chain
from modeling.model.batch import AttentionGroup, SeqSpan, StepBatch, StepRows
from modeling.model.config import ModelConfig
from modeling.model.decoder import DecoderModel
from modeling.model.kv_cache import KVCache, pages_for

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # sequences a graph steps, at most
MAX_GRAPH_POSITIONS = 4096  # positions a graph's block tables hold; a longer sequence's steps run eagerly


@dataclass(frozen=True, order=True)
class GraphShape:
    rows: int  # R: sequences, padded
    query_tokens: int  # T: new tokens of each, padded (1: decode; k + 1: verify)


def row_buckets(max_rows: int) -> list[int]:
    """ROW_BUCKETS up to the first that holds `max_rows` (all of them when none does)."""
    buckets = [rows for rows in ROW_BUCKETS if rows < max_rows]
    return buckets + [next((rows for rows in ROW_BUCKETS if rows >= max_rows), ROW_BUCKETS[-1])]


def query_buckets(max_query_tokens: int) -> list[int]:
    """1, 2, 4 ... below `max_query_tokens`, then it (a decode step's 1, and each verify length rounded up)."""
    buckets = [1]
    while buckets[-1] * 2 < max_query_tokens:
        buckets.append(buckets[-1] * 2)
    return buckets + ([max_query_tokens] if max_query_tokens > 1 else [])


def shapes_to_capture(max_rows: int, max_query_tokens: int) -> list[GraphShape]:
    """Every bucket, largest first (the smaller ones then reuse the pool's memory)."""
    shapes = [GraphShape(rows, tokens) for rows in row_buckets(max_rows) for tokens in query_buckets(max_query_tokens)]
    return sorted(shapes, reverse=True)


def graph_pool_estimate_bytes(
    config: ModelConfig, max_rows: int, max_query_tokens: int, capacity: int, dtype: torch.dtype
) -> int:
    """What the largest graph's activations take, as the KV budget reserves it: its logits and layer activations, the
    scores and mask over `capacity` positions, and one layer's keys and values gathered per row."""
    rows = row_buckets(max_rows)[-1] * max_query_tokens
    width = max(config.hidden_size, config.num_heads * config.head_dim)
    activations = rows * (config.vocab_size + 6 * width + 3 * config.intermediate_size) * dtype.itemsize
    scores = rows * capacity * (config.num_heads + 2) * 4
    gathered = 2 * row_buckets(max_rows)[-1] * config.num_kv_heads * capacity * config.head_dim * dtype.itemsize
    return activations + scores + 2 * gathered


class GraphBackend(Protocol):
    name: str

    def capture(self, run: Callable[[], None]) -> Callable[[], None]:
        """Capture `run` (which reads and writes only static buffers) and return what replays it."""
        ...

    def pool_bytes(self) -> int:
        """Device memory the captured graphs hold."""
        ...


class CudaGraphBackend:
    """torch.cuda graphs, all in one memory pool, each captured after a run on a side stream."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: list[torch.cuda.CUDAGraph] = []
        self._reserved_before = torch.cuda.memory_reserved(device)

    def capture(self, run: Callable[[], None]) -> Callable[[], None]:
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            run()  # lazy initialisation (cuBLAS workspaces) happens outside the capture
        torch.cuda.current_stream(self._device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            run()
        self._graphs.append(graph)
        return graph.replay

    def pool_bytes(self) -> int:
        return max(0, torch.cuda.memory_reserved(self._device) - self._reserved_before)


@dataclass
class RecordingBackend:
    """Graphs in name only: records what was captured and replayed, and replays by running the capture's function
    (the same static-buffer forward) eagerly. For tests, and the device check's dry run, on a CPU."""

    name: str = "recording"
    captured: list[str] = field(default_factory=list)
    replayed: list[str] = field(default_factory=list)
    _label: str = ""

    def capture(self, run: Callable[[], None]) -> Callable[[], None]:
        label = self._label
        self.captured.append(label)
        run()

        def replay() -> None:
            self.replayed.append(label)
            run()

        return replay

    def pool_bytes(self) -> int:
        return 0


class CaptureFailed(RuntimeError):
    """A graph could not be captured: the worker must not serve (or, with --cuda-graphs fallback, serves eagerly)."""


@dataclass
class _Graph:
    """One bucket's static buffers, its outputs and what replays it."""

    shape: GraphShape
    token_ids: torch.Tensor  # [R*T]
    positions: torch.Tensor  # [R*T] RoPE positions
    store_pages: torch.Tensor  # [R*T] where each row's keys and values go
    store_offsets: torch.Tensor  # [R*T]
    tables: torch.Tensor  # [R, W] block tables, padded with the scratch page
    attend_ends: torch.Tensor  # [R*T] the last of the positions 0 .. a row attends to
    extra: torch.Tensor  # [R*T, T] further positions a tree node attends to (its ancestors and itself), -1 past
    hidden: torch.Tensor | None = None  # [R*T, H] after a replay
    logits: torch.Tensor | None = None  # [R*T, V] in the model's dtype, after a replay
    replay: Callable[[], None] | None = None


class StepGraphs:
    """The captured graphs of one model and cache: `run` steps a batch through one, or says it fits none."""

    def __init__(
        self, model: DecoderModel, cache: KVCache, *, max_rows: int, max_query_tokens: int, capacity_pages: int
    ) -> None:
        if model.native is not None:
            raise CaptureFailed("graphs replay torch ops; this model runs the native CPU kernels")
        self._model, self._cache = model, cache
        self.scratch_page = cache.num_pages - 1  # the page padding reads and writes; never one the scheduler names
        self._page_size = cache.page_size
        self.capacity_pages = capacity_pages
        self.shapes = shapes_to_capture(max_rows, max_query_tokens)
        self._graphs: dict[GraphShape, _Graph] = {}
        self._sliding = any(width is not None for width in getattr(model, "_windows", []))
        self.num_replays = 0
        self.num_eager = 0

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def capture_all(self, backend: GraphBackend, before_each: Callable[[int], None] = lambda number: None) -> float:
        """Capture every bucket's graph, largest first; `before_each(n)` is called before the n-th (fault injection
        counts from 1). Raises CaptureFailed naming the graph. Returns the seconds it took."""
        started = time.perf_counter()
        for number, shape in enumerate(self.shapes, start=1):
            graph = self._buffers(shape)
            if isinstance(backend, RecordingBackend):
                backend._label = f"{shape.rows}x{shape.query_tokens}"
            try:
                before_each(number)
                with torch.inference_mode():
                    graph.replay = backend.capture(functools.partial(self._forward, graph))
            except Exception as error:  # any failure: the worker must not serve half-captured
                raise CaptureFailed(
                    f"capturing graph {number} of {len(self.shapes)} ({shape.rows} sequences of "
                    f"{shape.query_tokens} tokens) failed: {type(error).__name__}: {error}"
                ) from error
            self._graphs[shape] = graph
        return time.perf_counter() - started

    def shape_for(self, spans: Sequence[SeqSpan]) -> GraphShape | None:
        """The smallest captured bucket the step fits, or None: it runs eagerly."""
        if not spans or not self._graphs:
            return None
        longest = 0
        for span in spans:
            n = len(span.token_ids)
            tree = span.parents is not None and not is_chain(span.parents)
            if span.num_logits != n or len(span.pages) > self.capacity_pages or (tree and self._sliding):
                return None
            longest = max(longest, n)
        fitting = [shape for shape in self._graphs if shape.rows >= len(spans) and shape.query_tokens >= longest]
        return min(fitting, key=lambda shape: (shape.rows * shape.query_tokens, shape)) if fitting else None

    def run(self, spans: Sequence[SeqSpan]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's logits (model dtype) `[sum num_logits, V]` and hidden states `[sum len(token_ids), H]`, in span
        order, from the bucket's graph; None when the step fits none (the caller runs it eagerly)."""
        shape = self.shape_for(spans)
        if shape is None:
            self.num_eager += 1
            return None
        graph = self._graphs[shape]
        rows = self._fill(graph, spans)
        assert graph.replay is not None
        with torch.inference_mode():
            graph.replay()
            assert graph.logits is not None and graph.hidden is not None
            index = torch.tensor(rows, dtype=torch.long, device=graph.token_ids.device)
            self.num_replays += 1
            return graph.logits[index], graph.hidden[index]

    def _buffers(self, shape: GraphShape) -> _Graph:
        device = self._cache.keys.device
        n = shape.rows * shape.query_tokens

        def longs(*size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.long, device=device)

        graph = _Graph(
            shape,
            token_ids=longs(n),
            positions=longs(n),
            store_pages=longs(n).fill_(self.scratch_page),
            store_offsets=longs(n),
            tables=longs(shape.rows, self.capacity_pages).fill_(self.scratch_page),
            attend_ends=longs(n),
            extra=longs(n, shape.query_tokens).fill_(-1),
        )
        return graph

    def _forward(self, graph: _Graph) -> None:
        """The step at the graph's shape, from its static buffers only (no host reads: capturable)."""
        shape = graph.shape
        r, t = shape.rows, shape.query_tokens
        length = self.capacity_pages * self._page_size
        keys = torch.arange(length, device=graph.token_ids.device)
        allowed = keys.view(1, length) <= graph.attend_ends.view(-1, 1)  # [R*T, L]
        allowed = allowed | (keys.view(1, 1, length) == graph.extra.unsqueeze(-1)).any(dim=1)
        mask = torch.zeros(allowed.shape, dtype=torch.float32, device=keys.device).masked_fill_(~allowed, float("-inf"))
        every = torch.arange(r * t, device=keys.device)
        group = AttentionGroup(
            tables=graph.tables,
            num_rows=r,
            num_query_tokens=t,
            kv_len=length,
            query_rows=every,
            mask=mask.view(r, 1, t, length),
            real=every,
            real_rows=every,
            is_identity=True,
        )
        batch = StepBatch(
            graph.token_ids,
            graph.positions,
            graph.tables,
            torch.div(every, t, rounding_mode="floor"),
            graph.store_pages,
            graph.store_offsets,
            every,
            [group],
        )
        graph.hidden = self._model(batch, self._cache)
        graph.logits = self._model.logits(graph.hidden, widen=False)

    def _fill(self, graph: _Graph, spans: Sequence[SeqSpan]) -> list[int]:
        """Copy the step into the graph's buffers (padding: the scratch page, attending to its first position only);
        returns the rows that are the step's, in span order."""
        shape, size = graph.shape, self._page_size
        n = shape.rows * shape.query_tokens
        token_ids, positions = [0] * n, [0] * n
        store_pages, store_offsets = [self.scratch_page] * n, [0] * n
        attend_ends = [0] * n
        extra = [[-1] * shape.query_tokens for _ in range(n)]
        tables = [[self.scratch_page] * self.capacity_pages for _ in range(shape.rows)]
        real: list[int] = []
        for index, span in enumerate(spans):
            rows = StepRows()
            rows.add(span)
            base = index * shape.query_tokens
            tables[index][: len(span.pages)] = span.pages
            for offset, token in enumerate(span.token_ids):
                row = base + offset
                token_ids[row], positions[row], attend_ends[row] = (
                    token,
                    rows.positions[offset],
                    rows.attend_ends[offset],
                )
                stored = rows.stored_at[offset]
                store_pages[row], store_offsets[row] = span.pages[stored // size], stored % size
                if (further := rows.extra.get(offset)) is not None:
                    extra[row][: len(further)] = further
                real.append(row)
        for buffer, values in (
            (graph.token_ids, token_ids),
            (graph.positions, positions),
            (graph.store_pages, store_pages),
            (graph.store_offsets, store_offsets),
            (graph.attend_ends, attend_ends),
            (graph.extra, extra),
            (graph.tables, tables),
        ):
            buffer.copy_(torch.tensor(values, dtype=torch.long), non_blocking=True)
        return real


def graph_capacity_pages(max_model_len: int, page_size: int) -> int:
    """Pages a graph's block table holds: the whole context, up to MAX_GRAPH_POSITIONS."""
    return pages_for(min(max_model_len, MAX_GRAPH_POSITIONS), page_size)
