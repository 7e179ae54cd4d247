"""The native linear kernel against torch's CPU matmuls, per weight shape of the default model and rows per step.

For float32 the library is oneDNN on weights prepacked for it (what the model ran before
its linears had to be batch invariant); for bfloat16, oneDNN's packed kernel where this
CPU takes it, else torch's plain `F.linear`. Best of `--repeats` timings, threads as
torch has them (`--threads` sets them).

With `--blocks FORMAT` the native kernel reads GGUF blocks of that format instead (the
weights quantized by gguf's own quantizer), and the library runs on the dequantized
weights in float32; `--shapes` picks some of the shapes by index. `--path` names one of the
kernel's instruction-set paths this CPU has (default: the widest).

    python -m bench.linear_kernel --rows 1 4 16 64 256
    python -m bench.linear_kernel --blocks q4_1 --dtype float32 --shapes 2 --threads 1 --rows 1 4 16 64 128
    python -m bench.linear_kernel --blocks q4_1 --dtype float32 --threads 1 --rows 1 4 16 64 --path avx2

`--layers L` times instead what a decode step's layers ask of the kernel: L layers' four projections, each its
own weight (a 30-layer Q4_1 model's are 66 MB, far more than the caches hold), called in the model's order, as
the worker holds them (in one region of huge pages); the median pass's milliseconds and the weights'
bytes a second it reads them at. L = 1 or 2 is the same loop with the weights in cache.

    python -m bench.linear_kernel --blocks q4_1 --dtype bfloat16 --rows 1 --layers 30 --repeats 30
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from modeling.kernels.packing import PackedLinear, block_probe
from modeling.kernels.huge_pages import HugePageRegion
from modeling.kernels.native import native_ops
from modeling.kernels.blocks import panel_rows

# qkv, o, gate_up, down and the LM head of SmolLM2-135M: (out_features, in_features).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def best_ms(work: Callable[[], object], repeats: int) -> float:
    work()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def library_linear(weight: torch.Tensor) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 2)
        return "oneDNN packed", lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError:  # this CPU lacks what oneDNN's packed bf16 path needs
        return "F.linear", lambda x: F.linear(x, weight)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.linear_kernel", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument(
        "--blocks", choices=["q4_1", "q8_0", "q4_k"], help="time the kernel on GGUF blocks of this format"
    )
    parser.add_argument("--shapes", type=int, nargs="+", help="indices into the shapes (qkv, o, gate_up, down, head)")
    parser.add_argument("--path", help="the kernel's instruction-set path (default: the widest this CPU has)")
    parser.add_argument("--layers", type=int, help="time a decode step's layers: this many layers' own weights in turn")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = native_ops()
    if args.path is not None and args.path not in ops.linear_paths():
        parser.error(f"--path {args.path}: this CPU's paths are {', '.join(ops.linear_paths())}")
    linear = PackedLinear(ops, args.path)
    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"kernel path {linear.path} (this CPU has {list(ops.linear_paths())}), torch {torch.__version__}"
    )
    if args.layers:
        return layer_passes(linear, args)
    print("| dtype | weight | rows | native ms | library | library ms | native / library | native GFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    shapes = [SHAPES[i] for i in args.shapes] if args.shapes else SHAPES
    for dtype in (getattr(torch, name) for name in args.dtype):
        for num_out, depth in shapes:
            weight = (torch.randn(num_out, depth) * 0.05).to(dtype)
            if args.blocks:
                packed = block_probe(linear, args.blocks)(weight)
                dequantized = panel_rows(packed, args.blocks, ops.linear_panel_width(), torch.arange(num_out))
                name, library = library_linear(dequantized.to(dtype))
            else:
                packed = linear.pack(weight)
                name, library = library_linear(weight)
            for rows in args.rows:
                x = torch.randn(rows, depth).to(dtype)
                ours = best_ms(lambda: linear(x, packed), args.repeats)
                theirs = best_ms(lambda: library(x), args.repeats)
                print(
                    f"| {str(dtype).removeprefix('torch.')} | {num_out} x {depth} | {rows} | {ours:.3f} | {name} | "
                    f"{theirs:.3f} | {ours / theirs:.2f} | {2 * rows * num_out * depth / ours / 1e6:.0f} |",
                    flush=True,
                )
    return 0


def layer_passes(linear: PackedLinear, args: argparse.Namespace) -> int:
    """`--layers`: the median of `--repeats` passes over the layers' projections, each row count and dtype."""
    print("| dtype | weights | layers | rows | ms a pass | weights MB | GB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    generator = torch.Generator().manual_seed(0)
    for dtype in (getattr(torch, name) for name in args.dtype):
        weights = []
        for _ in range(args.layers):
            for num_out, depth in SHAPES[:4]:
                weight = (torch.randn(num_out, depth, generator=generator) * 0.05).to(dtype)
                weights.append(block_probe(linear, args.blocks)(weight) if args.blocks else linear.pack(weight))
        region = HugePageRegion.holding(weights)
        weights = [linear.move(weight, region) for weight in weights]
        nbytes = sum(weight.numel() * weight.element_size() for weight in weights)
        for rows in args.rows:
            inputs = {depth: torch.randn(rows, depth, generator=generator).to(dtype) for _, depth in SHAPES[:4]}
            calls = [(weight, inputs[depth]) for weight, (_, depth) in zip(weights, SHAPES[:4] * args.layers)]
            passes = []
            for _ in range(args.repeats + 1):
                started = time.perf_counter()
                for weight, x in calls:
                    linear(x, weight)
                passes.append(time.perf_counter() - started)
            ms = statistics.median(passes[1:]) * 1e3
            print(
                f"| {str(dtype).removeprefix('torch.')} | {args.blocks or 'dense'} | {args.layers} | "
                f"{rows} | {ms:.2f} | "
                f"{nbytes / 1e6:.1f} | {nbytes / ms / 1e6:.1f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
