"""The native row-by-row ops alone, at the embedded model's widths: the fused norm, RoPE, silu_mul, and the greedy
argmax against torch's.

Each op runs on the same rows again and again (in the caches; RoPE on a fresh copy each call, the copy's time taken
off), best of seven runs of `--calls` calls, microseconds a call, on the threads torch has.

    python -m bench.row_ops --rows 8 64 512
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

HIDDEN, INTERMEDIATE, HEADS, HEAD_DIM, VOCAB = 576, 1536, 12, 64, 49152  # q and k heads: the ones RoPE turns


def best_us(call: Callable[[], object], calls: int) -> float:
    best = float("inf")
    for _ in range(7):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    from modeling.kernels.native import native_ops

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    ops = native_ops()
    generator = torch.Generator().manual_seed(0)

    def rows_of(rows: int, width: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(rows, width, generator=generator).to(dtype)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; microseconds a call")
    print()
    print("| rows | add_rms_norm_ | silu_mul | rope_ | argmax_rows (float32 logits) | torch.argmax |")
    print("|---:|---:|---:|---:|---:|---:|")
    weight = rows_of(1, HIDDEN)[0]
    for rows in args.rows:
        x, delta = rows_of(rows, HIDDEN), torch.zeros(rows, HIDDEN, dtype=torch.bfloat16)  # x stays as it is
        gate_up = rows_of(rows, 2 * INTERMEDIATE)
        qkv0, cos, sin = rows_of(rows, HEADS * HEAD_DIM), rows_of(rows, HEAD_DIM), rows_of(rows, HEAD_DIM)
        qkv = qkv0.clone()
        logits = rows_of(rows, VOCAB, torch.float32)
        copy = best_us(lambda: qkv.copy_(qkv0), args.calls)
        norm = best_us(lambda: ops.add_rms_norm_(x, delta, weight, 1e-5), args.calls)
        silu = best_us(lambda: ops.silu_mul(gate_up), args.calls)
        rope = best_us(lambda: (qkv.copy_(qkv0), ops.rope_(qkv, cos, sin, HEADS, HEAD_DIM)), args.calls) - copy
        native = best_us(lambda: ops.argmax_rows(logits), max(args.calls // 10, 5))
        library = best_us(lambda: torch.argmax(logits, dim=-1), max(args.calls // 10, 5))
        print(f"| {rows} | {norm:.1f} | {silu:.1f} | {rope:.1f} | {native:.1f} | {library:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
