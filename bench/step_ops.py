"""Where a decode step's time goes: each native op of the model's layer loop, timed call by call.

The worker runs a step's layers in one native call (`DecoderStack`), which cannot be timed
inside. Here the same kernels are called one by one from the Python layer loop (the path a
model the stack cannot take runs), each call timed, and the step's whole time printed beside
them; the loop's own Python overhead is in the total, not in any op. Linears are split by
their output width (at the embedded model's shapes: 960 q|k|v, 576 o and down, 3072
gate|up, the vocabulary for the LM head). B sequences of `--context` cached positions each
take one new token, as in `bench.roofline`.

    python -m bench.step_ops --dtype bfloat16 --quantization q4_1 --batch 1 64
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.roofline import (
    QUANTIZATIONS,
    add_step_arguments,
    cpu_flags,
    cpu_name,
    decode_engine,
    decode_step_ms,
    filled_tables,
)
from common.cpus import usable_cpus
from modeling.model.batch import SeqSpan
from modeling.model.config import ModelConfig


class _TimedOps:
    """The native module, each call of its functions timed into `times[name]`."""

    def __init__(self, ops: Any, times: dict[str, list[float]]) -> None:
        self._ops, self._times = ops, times

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._ops, name)
        if not callable(target) or isinstance(target, type):
            return target
        return _timed(target, self._times, lambda _: name)


def _timed(
    call: Callable[..., Any], times: dict[str, list[float]], name_of: Callable[[Any], str]
) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = call(*args, **kwargs)
        times[name_of(result)].append(time.perf_counter() - started)
        return result

    return timed


def main(argv: Sequence[str] | None = None) -> int:
    from specserve.up import resolve_model

    parser = argparse.ArgumentParser(
        prog="python -m bench.step_ops", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_step_arguments(parser)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="q4_1")
    parser.set_defaults(batch=[1, 64])
    args = parser.parse_args(argv)
    threads = args.threads or usable_cpus()
    folder = resolve_model(args.model)
    engine = decode_engine(
        folder,
        ModelConfig.from_folder(folder),
        args.dtype,
        args.quantization,
        args.batch,
        args.context,
        args.repeats,
        threads,
    )
    model = engine.model
    if model.native is None:
        print(f"no native kernels here ({engine.ops}): nothing to time", file=sys.stderr)
        return 1
    times: dict[str, list[float]] = collections.defaultdict(list)
    model.fused_layers = None  # the layer loop, op by op
    setattr(model, "native", _TimedOps(model.native, times))  # a stand-in for the module, as the loop calls it
    model.linear = _timed(model.linear, times, lambda out: f"linear to {out.shape[-1]}")
    print(
        f"{cpu_name()} ({cpu_flags()}), {threads} threads, torch {torch.__version__}, "
        f"{folder.name}, {args.dtype}, {args.quantization}, {engine.ops}, context {args.context}"
    )
    for batch in args.batch:
        tables = filled_tables(engine, batch, args.context, args.repeats)
        times.clear()
        step_ms = decode_step_ms(engine, batch, args.context, args.repeats, tables)
        steps = args.repeats + 1  # every step decode_step_ms ran, its untimed first included
        print(f"\nB = {batch}: step {step_ms:.2f} ms (median)\n")
        print("| op | calls a step | ms a step | share of the step | median call, us |")
        print("|---|---:|---:|---:|---:|")
        for name, taken in sorted(times.items(), key=lambda item: -sum(item[1])):
            per_step = sum(taken) / steps * 1e3
            print(
                f"| {name} | {len(taken) / steps:.0f} | {per_step:.3f} | {per_step / step_ms:.0%} | "
                f"{statistics.median(taken) * 1e6:.1f} |"
            )
        spans = [SeqSpan(table, args.context, [42], 1) for table in tables]
        logits = engine.forward_with_features(spans, widen_logits=False)[0]
        print(f"\nB = {batch}, the greedy tokens of the step's logits: {greedy_costs(model, logits, args.repeats)}")
    return 0


def greedy_costs(model: Any, logits: torch.Tensor, repeats: int) -> str:
    """Median ms of what the worker's greedy tokens take: widening the LM head's logits to float32, torch's argmax
    over them, the native argmax over them, and the native argmax over the logits as the head gives them."""
    widened = logits.float()
    costs = {
        "widening": lambda: logits.float(),
        "torch.argmax": lambda: torch.argmax(widened, dim=-1),
        "argmax_rows": lambda: model.native.argmax_rows(widened),
        f"argmax_rows on {str(logits.dtype).removeprefix('torch.')}": lambda: model.native.argmax_rows(logits),
    }
    said = []
    for name, call in costs.items():
        taken = []
        for _ in range(repeats):
            started = time.perf_counter()
            call()
            taken.append(time.perf_counter() - started)
        said.append(f"{name} {statistics.median(taken) * 1e3:.3f} ms")
    return ", ".join(said)


if __name__ == "__main__":
    raise SystemExit(main())
