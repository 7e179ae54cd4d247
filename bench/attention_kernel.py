"""The native attention kernel in a model-like sequence: every layer its own paged cache, other memory read between.

A decode step runs attention once a layer, each over a cache the step has not read yet, with
the layer's weights streamed in between; a kernel timed again and again on one cache reads it
from the processor's caches instead and flatters itself. Here each of `--layers` layers has
its own keys and values (SmolLM2-135M's shapes by default: 3 kv heads, 9 query heads,
head_dim 64, pages of 16), and `--between-mb` of other memory is summed before each layer.
The figure is the attention time of one step (all layers), best and median of `--repeats`.

    python -m bench.attention_kernel --rows 1 16 64 --positions 200
    python -m bench.attention_kernel --dtype bfloat16 --rows 64 --positions 192 --path avx512 avx2

`--path` names the kernel's paths to time (`attention_paths()` lists a build's), each in turn
at every row count; by default the build's fastest.

To set it against an earlier revision, run the same file with that revision's modules first
on the path (its kernels are built there):

    git worktree add /tmp/before REV && PYTHONPATH=/tmp/before python bench/attention_kernel.py
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Sequence

import torch

from modeling.kernels.native import native_ops

PAGE_SIZE = 16


def step_ms(ops, rows: int, positions: int, args: argparse.Namespace, path: str) -> list[float]:
    """Milliseconds of attention on `path` ("": the build's fastest) in each of `args.repeats` steps of `rows` rows
    at `positions` positions."""
    pages_per_row = -(-positions // PAGE_SIZE)
    generator = torch.Generator().manual_seed(0)
    shape = (rows * pages_per_row, args.kv_heads, PAGE_SIZE, args.head_dim)
    dtype = getattr(torch, args.dtype)
    caches = [
        (torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype))
        for _ in range(args.layers)
    ]
    tables = torch.arange(rows * pages_per_row).view(rows, pages_per_row)
    queries = torch.randn(rows, args.heads, args.head_dim, generator=generator).to(dtype)
    row_tables = torch.arange(rows)
    last = torch.full((rows,), positions - 1)
    between = torch.randn(max(1, args.between_mb * 2**20 // 4 // args.layers) * args.layers, generator=generator)
    chunk = between.numel() // args.layers
    scale = args.head_dim**-0.5

    def one_step() -> float:
        total = 0.0
        for layer, (keys, values) in enumerate(caches):
            between[layer * chunk : (layer + 1) * chunk].sum()
            start = time.perf_counter()
            if path:
                ops.attend(queries, keys, values, tables, row_tables, last, scale, None, path=path)
            else:  # a revision whose kernel has one path per build
                ops.attend(queries, keys, values, tables, row_tables, last, scale, None)
            total += time.perf_counter() - start
        return total * 1e3

    for _ in range(2):
        one_step()
    return [one_step() for _ in range(args.repeats)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--positions", type=int, nargs="+", default=[200])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--between-mb", type=int, default=80, help="memory summed between layers, in all (the weights)")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as torch has them)")
    parser.add_argument("--path", nargs="+", default=[""], help="the kernel's paths to time (default: the fastest)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = native_ops()
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {args.dtype}, "
        f"{args.layers} layers of {args.heads} heads / {args.kv_heads} kv heads / head_dim {args.head_dim}"
    )
    print("| path | rows | positions | KV read per step, MB | step ms, best | median | GB/s at best |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    element = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    for rows in args.rows:
        for positions in args.positions:
            for path in args.path:
                times = step_ms(ops, rows, positions, args, path)
                megabytes = 2 * rows * positions * args.kv_heads * args.head_dim * element * args.layers / 1e6
                best = min(times)
                named = path or (ops.attention_paths()[0] if hasattr(ops, "attention_paths") else "the build's")
                print(
                    f"| {named} | {rows} | {positions} | {megabytes:.0f} | {best:.2f} | "
                    f"{statistics.median(times):.2f} | {megabytes / best:.1f} |"
                )


if __name__ == "__main__":
    main()
