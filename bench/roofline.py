"""This machine's memory and matmul bounds, and how close the model's decode steps come to them.

Measured on the threads a target worker computes on (`--threads`, default the cores this process may
use; the native kernels' team, torch's own ops then on one thread, as `modeling/kernels/threads.py` says), in
one sitting:

- read bandwidth: the best of a few sums of a 1 GiB float32 tensor (far larger than any
  cache), in GB/s, measured again just before each row's steps: a shared host's bandwidth
  drifts with its other tenants' load (28-61 GB/s within an hour on one machine), and a
  step is held against what the memory gave in the same minute;
- matmul peak: the best of `--repeats` 2048 x 2048 x 2048 matmuls in the serving dtype and
  in float32, whichever is faster (torch's library GEMM; the native kernels widen bfloat16
  to float32 and sum there, so on a CPU without bfloat16 arithmetic float32's peak is the
  one that bounds them);
- decode steps of the model alone (`modeling.model.engine.ModelEngine`, the kernels a worker
  runs): B sequences of `--context` cached positions each take one new token; the median of
  `--repeats` steps.

For each B the step's bound is the larger of its bytes over the bandwidth and its FLOPs
over the matmul peak. Bytes served: every matmul weight once (q, k, v, o, gate, up, down
and the LM head, which is the embedding table when they are tied) as the engine holds it
(GGUF blocks with `--quantization q4_1`, scales included) plus the keys and values the
step reads; FLOPs: 2 per weight per row, plus attention's 4 per cached
position, head and head dimension. The table gives each step as a multiple of its bound.

With `--prefill N ...`, a second table: a prompt of N tokens computed in one step (its logits
for the last position only), its tokens a second, and its FLOPs a second against the matmul
peak in the dtype.

    python -m bench.roofline --dtype float32 bfloat16 --quantization none q4_1 --batch 1 4 16 64 --prefill 512
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.linear_kernel import best_ms
from common.cpus import usable_cpus
from modeling.model.batch import SeqSpan
from modeling.model.config import ModelConfig
from modeling.model.engine import ModelEngine
from modeling.model.kv_cache import pages_for
from modeling.kernels.blocks import QUANTIZATIONS
from modeling.kernels.threads import compute_on

GIB = 1 << 30
_MATMUL_SIZE = 2048


@dataclass(frozen=True)
class Bounds:
    read_gb_s: float
    matmul_tflop_s: float


@dataclass(frozen=True)
class StepCost:
    bytes: float
    flops: float

    def bound_ms(self, bounds: Bounds) -> float:
        return max(self.bytes / (bounds.read_gb_s * 1e9), self.flops / (bounds.matmul_tflop_s * 1e12)) * 1e3

    def limited_by(self, bounds: Bounds) -> str:
        return (
            "memory"
            if self.bytes / (bounds.read_gb_s * 1e9) >= self.flops / (bounds.matmul_tflop_s * 1e12)
            else "compute"
        )


def read_gb_s(data: torch.Tensor, repeats: int) -> float:
    """GB/s of the best of `repeats` sums of `data` (a tensor far larger than the caches)."""
    return data.numel() * data.element_size() / (best_ms(lambda: data.sum(), repeats) / 1e3) / 1e9


def matmul_tflop_s(dtype: torch.dtype, repeats: int) -> float:
    """The library GEMM's best pace in `dtype` or float32, whichever is faster (see the module's note)."""
    matmul_s = float("inf")
    for kind in {dtype, torch.float32}:
        a = torch.randn(_MATMUL_SIZE, _MATMUL_SIZE).to(kind)
        b = torch.randn(_MATMUL_SIZE, _MATMUL_SIZE).to(kind)
        matmul_s = min(matmul_s, best_ms(lambda: a @ b, repeats) / 1e3)  # noqa: B023 - timed before the next kind
    return 2 * _MATMUL_SIZE**3 / matmul_s / 1e12


def matmul_params(config: ModelConfig) -> int:
    """The weights a decode step multiplies by: every layer's projections and the LM head."""
    q, kv, hidden = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.hidden_size
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * config.intermediate_size
    return config.num_layers * per_layer + config.vocab_size * hidden


def step_cost(
    config: ModelConfig, batch: int, context: int, itemsize: int, weight_bytes: int | None = None
) -> StepCost:
    """`weight_bytes`: what the matmul weights take as served (default: `itemsize` each)."""
    params = matmul_params(config)
    kv_bytes = batch * context * config.num_layers * 2 * config.num_kv_heads * config.head_dim * itemsize
    attention_flops = 4 * batch * context * config.num_layers * config.num_heads * config.head_dim
    weights = params * itemsize if weight_bytes is None else weight_bytes
    return StepCost(bytes=weights + kv_bytes, flops=2 * batch * params + attention_flops)


def prefill_flops(config: ModelConfig, num_tokens: int) -> float:
    """A prompt of `num_tokens` computed in one step: every projection for each token, the LM head for the last one
    only (its logits are all a prefill asks for), and causal attention's 4 per attended position, head and head dim."""
    head = config.vocab_size * config.hidden_size
    attended = num_tokens * (num_tokens + 1) / 2
    return (
        2 * (matmul_params(config) - head) * num_tokens
        + 2 * head
        + 4 * attended * config.num_layers * config.num_heads * config.head_dim
    )


def prefill_ms(engine: ModelEngine, num_tokens: int, repeats: int) -> float:
    """The median time of computing a prompt of `num_tokens` in one step (its pages written afresh each time)."""
    pages = tuple(range(pages_for(num_tokens + 1, engine.page_size)))
    prompt = [(7 * p) % 1000 + 100 for p in range(num_tokens)]
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        engine.forward([SeqSpan(pages, 0, prompt, 1)])
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:]) * 1e3


def filled_tables(engine: ModelEngine, batch: int, context: int, repeats: int) -> list[tuple[int, ...]]:
    """The block tables of `batch` sequences whose first `context` positions are now in the cache."""
    pages_each = pages_for(context + repeats + 2, engine.page_size)
    tables = [tuple(range(i * pages_each, (i + 1) * pages_each)) for i in range(batch)]
    prompt = [(7 * p) % 1000 + 100 for p in range(context)]
    for table in tables:
        engine.forward([SeqSpan(table, 0, prompt, 1)])
    return tables


def decode_step_ms(
    engine: ModelEngine, batch: int, context: int, repeats: int, tables: list[tuple[int, ...]] | None = None
) -> float:
    """The median time of a step in which `batch` sequences of `context` positions each take one new token (the
    sequences of `tables`, filled by `filled_tables`, or filled here); `repeats` + 1 steps run, the first untimed."""
    if tables is None:
        tables = filled_tables(engine, batch, context, repeats)
    times = []
    for step in range(repeats + 1):
        spans = [SeqSpan(table, context + step, [42], 1) for table in tables]
        started = time.perf_counter()
        engine.forward(spans)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:]) * 1e3


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's ops on `threads` threads inside (the probes: torch's sum and matmul), as many as before after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def decode_engine(
    folder: Path,
    config: ModelConfig,
    dtype: str,
    quantization: str,
    batches: Sequence[int],
    context: int,
    repeats: int,
    threads: int,
    prompt_len: int = 0,
) -> ModelEngine:
    """The model on the CPU, built on `threads` threads as a worker computes, and with a cache for the sequences
    decode_step_ms runs at the largest batch (and a prompt of `prompt_len` tokens)."""
    length = max(context + repeats + 2, prompt_len + 1)
    torch.set_num_threads(threads)  # loading: torch's ops on every thread, as a worker loads
    engine = ModelEngine(
        folder,
        config,
        device="cpu",
        dtype=dtype,
        max_len=length,
        quantization=quantization,
        num_pages=max(batches) * pages_for(length, 16) + 8,
    )
    engine.load()
    # As a worker does: torch's ops on one thread beside the kernels' team. On torch's own threads, the ops that go
    # parallel from 6 rows up leave OpenMP's threads spinning on the team's cores, and a step takes up to twice its
    # time (docs/benchmarks.md, "The roofline on a worker's threads").
    compute_on(threads, native=engine.native)
    engine.allocate()
    return engine


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and the decode steps to run: --model, --batch, --context, --repeats, --threads."""
    parser.add_argument(
        "--model", default=None, help="what `specserve up --model` takes (default: the embedded default)"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--context", type=int, default=160, help="cached positions of each sequence")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> str:
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "?"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return " ".join(f for f in wanted if f in flags) or "none of " + ", ".join(wanted)


def main(argv: Sequence[str] | None = None) -> int:
    from specserve.up import resolve_model

    parser = argparse.ArgumentParser(
        prog="python -m bench.roofline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_step_arguments(parser)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), nargs="+", default=["float32"])
    parser.add_argument("--quantization", choices=QUANTIZATIONS, nargs="+", default=["none"])
    parser.add_argument(
        "--prefill",
        type=int,
        nargs="*",
        default=[],
        help="also time prompts of these many tokens computed in one step, against the matmul peak",
    )
    args = parser.parse_args(argv)
    threads = args.threads or usable_cpus()
    folder = resolve_model(args.model)
    config = ModelConfig.from_folder(folder)
    print(
        f"{cpu_name()} ({cpu_flags()}), {threads} threads, torch {torch.__version__}, "
        f"{folder.name}, context {args.context}"
    )
    print()
    print("| dtype | weights | read GB/s | matmul TFLOP/s | B | step ms | bound ms | limited by | step / bound |")
    print("|---|---|---:|---:|---:|---:|---:|---|---:|")
    prefills: list[str] = []
    probe = torch.ones(GIB // 4, dtype=torch.float32)
    probe_repeats = max(3, args.repeats // 4)
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        with torch_threads(threads):
            peak = matmul_tflop_s(dtype, probe_repeats)
        for quantization in args.quantization:
            engine = decode_engine(
                folder,
                config,
                dtype_name,
                quantization,
                args.batch,
                args.context,
                args.repeats,
                threads,
                max(args.prefill, default=0),
            )
            weights = "dense" if quantization == "none" else quantization
            for batch in args.batch:
                cost = step_cost(config, batch, args.context, dtype.itemsize, engine.linear_weight_bytes())
                with torch_threads(threads):
                    bounds = Bounds(read_gb_s=read_gb_s(probe, probe_repeats), matmul_tflop_s=peak)
                step_ms = decode_step_ms(engine, batch, args.context, args.repeats)
                bound_ms = cost.bound_ms(bounds)
                print(
                    f"| {dtype_name} | {weights} | {bounds.read_gb_s:.1f} | {bounds.matmul_tflop_s:.2f} | {batch} | "
                    f"{step_ms:.1f} | {bound_ms:.1f} | {cost.limited_by(bounds)} | {step_ms / bound_ms:.2f} |",
                    flush=True,
                )
            for num_tokens in args.prefill:
                taken_ms = prefill_ms(engine, num_tokens, args.repeats)
                tflop_s = prefill_flops(config, num_tokens) / (taken_ms / 1e3) / 1e12
                prefills.append(
                    f"| {dtype_name} | {weights} | {num_tokens} | {taken_ms:.1f} | "
                    f"{num_tokens / taken_ms * 1e3:.0f} | {tflop_s:.3f} | {peak:.2f} | {tflop_s / peak:.2f} |"
                )
            del engine
    if prefills:
        print("\nPrefill: one prompt computed in one step, against the matmul peak in the dtype\n")
        print("| dtype | weights | prompt tokens | ms | tokens/s | TFLOP/s | peak TFLOP/s | of the peak |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        print("\n".join(prefills))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
