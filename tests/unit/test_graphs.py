"""Decode and verify steps through captured graphs (modeling/model/graphs.py), on the recording backend: the same
static-buffer forward a CUDA graph replays, run eagerly on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from unittest.mock import patch

from common.faults import FaultInjector, parse_faults
from common.process_config import ProcessConfig
from gpu_worker import memory
from gpu_worker.config import WorkerConfig
from modeling.model.batch import SeqSpan
from modeling.model.config import ModelConfig
from modeling.model.decoder import TORCH_OPS
from modeling.model.engine import ModelEngine
from modeling.model.graphs import (
    CaptureFailed,
    GraphShape,
    RecordingBackend,
    query_buckets,
    row_buckets,
    shapes_to_capture,
)

PAGE = 4
NUM_PAGES = 40
MAX_LEN = 64


def engine(folder: Path, monkeypatch: pytest.MonkeyPatch, scratch: bool = True) -> ModelEngine:
    monkeypatch.setattr("modeling.model.engine.choose_ops", lambda *args: TORCH_OPS)  # graphs replay torch ops
    built = ModelEngine(
        folder,
        ModelConfig.from_folder(folder),
        device="cpu",
        dtype="float32",
        num_pages=NUM_PAGES,
        max_len=MAX_LEN,
        page_size=PAGE,
    )
    built.load()
    built.allocate(scratch_page=scratch)
    return built


def test_buckets_cover_every_row_count_and_verify_length_largest_first() -> None:
    assert row_buckets(1) == [1] and row_buckets(5) == [1, 2, 4, 8] and row_buckets(256)[-1] == 256
    assert row_buckets(1000)[-1] == 256  # more sequences than the largest bucket step eagerly
    assert query_buckets(1) == [1] and query_buckets(7) == [1, 2, 4, 7] and query_buckets(4) == [1, 2, 4]
    shapes = shapes_to_capture(3, 3)
    assert shapes == sorted(shapes, reverse=True) and set(shapes) == {
        GraphShape(rows, tokens) for rows in (1, 2, 4) for tokens in (1, 2, 3)
    }


def prompt(built: ModelEngine, pages: tuple[int, ...], length: int, seed: int) -> list[int]:
    tokens = [(seed * 13 + 7 * i) % built.config.vocab_size for i in range(length)]
    built.forward([SeqSpan(pages, 0, tokens, 1)])
    return tokens


def test_a_step_through_its_graph_gives_the_eager_steps_logits_and_padding_touches_only_the_scratch_page(
    tiny_llama_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three sequences (a decode, a verify chain, a token tree) in the 4-row, 4-token bucket: the same logits and
    hidden states as the eager step, and no page but the scratch page and the step's own positions changed."""
    eager, graphed = engine(tiny_llama_folder, monkeypatch), engine(tiny_llama_folder, monkeypatch)
    backend = RecordingBackend()
    graphed.capture_graphs(backend, max_rows=4, max_query_tokens=4)
    assert graphed.graphs is not None and graphed.graphs.num_graphs == len(backend.captured) == 9
    tables = [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    for built in (eager, graphed):
        for seed, table in enumerate(tables):
            prompt(built, table, 9, seed)
    before = graphed._cache.keys.clone()  # type: ignore[union-attr]
    spans = [
        SeqSpan(tables[0], 9, [5], 1),
        SeqSpan(tables[1], 9, [5, 6, 7], 3),
        SeqSpan(tables[2], 9, [5, 6, 7, 8], 4, parents=(-1, -1, 0)),
    ]
    logits, hidden = eager.forward_with_features(spans)
    replayed_logits, replayed_hidden = graphed.forward_with_features(spans)
    assert backend.replayed == ["4x4"]
    torch.testing.assert_close(replayed_logits, logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(replayed_hidden, hidden, rtol=1e-4, atol=1e-4)
    after = graphed._cache.keys  # type: ignore[union-attr]
    changed = {int(page) for page in (after != before).any(dim=(0, 2, 3, 4)).nonzero().flatten()}
    written = {tables[0][9 // PAGE], tables[1][9 // PAGE], tables[1][11 // PAGE], tables[2][9 // PAGE]}
    written |= {tables[2][12 // PAGE]}
    assert changed <= written | {NUM_PAGES}  # the step's own positions, and the scratch page
    assert NUM_PAGES in changed  # padding rows wrote there, and only there


def test_steps_that_fit_no_bucket_run_eagerly(tiny_llama_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = engine(tiny_llama_folder, monkeypatch)
    backend = RecordingBackend()
    built.capture_graphs(backend, max_rows=2, max_query_tokens=2)
    graphs = built.graphs
    assert graphs is not None
    table = tuple(range(8))
    prompt(built, table, 6, 1)
    eager_before = graphs.num_eager
    built.forward([SeqSpan(table, 6, [1, 2, 3], 3)])  # longer than any bucket's tokens
    built.forward([SeqSpan((20 + i,), 0, [1], 1) for i in range(3)])  # more sequences than any bucket
    built.forward([SeqSpan(table, 6, [1, 2], 1)])  # a prefill chunk (one logit for two tokens)
    long_table = tuple(range(graphs.capacity_pages + 1))
    built.forward([SeqSpan(long_table, 0, [1], 1)])  # a block table past the graphs' capacity
    assert graphs.num_eager == eager_before + 4 and backend.replayed == []
    built.forward([SeqSpan(table, 6, [1], 1)])
    assert backend.replayed == ["1x1"]


def test_graphs_need_the_scratch_page_and_torch_ops(tiny_llama_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RuntimeError, match="scratch page"):
        engine(tiny_llama_folder, monkeypatch, scratch=False).capture_graphs(RecordingBackend(), 1, 1)


@pytest.mark.parametrize("number", [1, 3])
def test_a_capture_that_raises_part_way_leaves_no_graph_in_use(
    tiny_llama_folder: Path, monkeypatch: pytest.MonkeyPatch, number: int
) -> None:
    """The founding bug: a capture that fails half-way must not leave a half-built replica that serves. The engine
    keeps no graphs, and the error names the graph it failed at."""
    built = engine(tiny_llama_folder, monkeypatch)
    faults = FaultInjector("worker-0", {"SPECSERVE_FAULT": f"worker-0:capture={number}:raise"})
    with pytest.raises(CaptureFailed, match=f"graph {number} of 4 .*InjectedFault"):
        built.capture_graphs(RecordingBackend(), 2, 2, faults.at_capture)
    assert built.graphs is None

    class Broken(RecordingBackend):
        def capture(self, run):  # type: ignore[no-untyped-def]
            if len(self.captured) == number - 1:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (as a capture may run out)")
            return super().capture(run)

    with pytest.raises(CaptureFailed, match=f"graph {number} of 4 .*OutOfMemoryError"):
        built.capture_graphs(Broken(), 2, 2)
    assert built.graphs is None


def test_capture_faults_are_parsed_and_counted_from_one() -> None:
    assert [f.capture for f in parse_faults("worker-0:capture=2:hang;worker-1:capture=1:exit")] == [2, 1]
    with pytest.raises(ValueError, match="count from 1"):
        parse_faults("worker-0:capture=0:raise")


def test_the_graphs_pool_comes_out_of_a_cuda_workers_kv_budget(tiny_llama_folder: Path) -> None:
    """On CUDA the graphs' estimated pool is taken from the share of free memory the KV cache gets (and their scratch
    page from its pages); on a CPU, and with graphs off, nothing is."""
    model = ModelConfig.from_folder(tiny_llama_folder)

    def budget(device: str, graphs: str, available_gib: float) -> tuple[int, str]:
        process = ProcessConfig("worker-0", "tcp://127.0.0.1:1", device, "float32", 1.0, 60.0, 60.0, 5.0, 1, None)
        config = WorkerConfig(process, tiny_llama_folder, 4096, None, 16, 256, 512, 6, cuda_graphs=graphs)
        with patch.object(memory, "available_memory_bytes", lambda device: int(available_gib * memory.GIB)):
            return memory.kv_cache_budget_bytes(config, model)

    plain, _ = budget("cuda:0", "off", 2.0)
    reserved, why = budget("cuda:0", "on", 2.0)
    assert 0 < plain - reserved < plain and "CUDA graphs" in why
    assert budget("cpu", "on", 0.5) == budget("cpu", "off", 0.5)
