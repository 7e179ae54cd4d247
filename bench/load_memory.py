"""Peak resident memory of loading a model folder, against the size of its weights in the serving dtype.

Each case runs in a fresh subprocess, which imports torch and the loader's modules, resets
its peak (`5` into /proc/self/clear_refs, where the kernel allows it), notes VmRSS as the
baseline, loads, and reads VmHWM from /proc/self/status. The ratio is
(peak - baseline) / (the checkpoint's element count x the serving dtype's size): about 1.0
means the load held nothing but the weights themselves.

Loaders: `engine` (default) builds `modeling.model.engine.ModelEngine(...).load()` on the CPU;
`reader-only` allocates every tensor in the serving dtype and reads it through
`modeling.model.weights.WeightFiles`; `MODULE:FUNCTION` calls FUNCTION(folder, dtype) of your own.
Without --folder the cases are the default model (float32 files) into float32 and bfloat16,
and a sharded Llama of about 300 MB in bfloat16 files, made here with transformers, into
bfloat16 and float32.

    python -m bench.load_memory
    python -m bench.load_memory --reader-only
    python -m bench.load_memory --folder DIR --dtype bfloat16 --loader mypkg.loading:load
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from modeling.model.weights import WeightFiles

_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Loader:
    function: str  # "module:function", called as function(folder, dtype) and returning what holds the weights
    preload: tuple[str, ...] = ()  # modules imported before the baseline, so that importing them does not count


LOADERS = {
    "engine": Loader("bench.load_memory:load_with_engine", ("modeling.model.engine", "modeling.model.config")),
    "reader-only": Loader("bench.load_memory:load_with_reader"),
}


@dataclass(frozen=True)
class Measurement:
    folder: Path
    dtype: str  # the serving dtype
    loader: str
    baseline_bytes: int  # VmRSS after imports, before loading
    peak_bytes: int  # VmHWM after loading
    weights_bytes: int  # the checkpoint's elements in the serving dtype
    peak_reset: bool  # whether VmHWM was reset before the baseline (else it also covers the imports)

    @property
    def ratio(self) -> float:
        return (self.peak_bytes - self.baseline_bytes) / self.weights_bytes


def load_with_engine(folder: Path, dtype: torch.dtype) -> object:
    from modeling.model.config import ModelConfig
    from modeling.model.engine import ModelEngine

    engine = ModelEngine(
        folder,
        ModelConfig.from_folder(folder),
        device="cpu",
        dtype=str(dtype).removeprefix("torch."),
        num_pages=8,
        max_len=64,
    )
    engine.load()
    return engine


def load_with_reader(folder: Path, dtype: torch.dtype) -> object:
    files = WeightFiles(folder)
    tensors = {name: torch.empty(files.shape(name), dtype=dtype) for name in sorted(files.names())}
    for name, tensor in tensors.items():
        files.read_into(name, tensor)
    return tensors


def weights_bytes(folder: Path, dtype: torch.dtype) -> int:
    files = WeightFiles(folder)
    return sum(torch.Size(files.shape(name)).numel() for name in files.names()) * dtype.itemsize


def measure(folder: Path, dtype: str, loader: str = "engine") -> Measurement:
    """Load `folder` into `dtype` with `loader` (a name in LOADERS or "module:function") in a fresh subprocess."""
    spec = LOADERS.get(loader, Loader(loader))
    command = [sys.executable, "-m", "bench.load_memory", "--child", str(folder), dtype, spec.function, *spec.preload]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=_ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"loading {folder} with {loader} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    child = json.loads(done.stdout.strip().splitlines()[-1])
    return Measurement(
        folder,
        dtype,
        loader,
        child["baseline_bytes"],
        child["peak_bytes"],
        weights_bytes(folder, getattr(torch, dtype)),
        child["peak_reset"],
    )


def _child(folder: Path, dtype: str, function: str, preload: Sequence[str]) -> None:
    """In the measured process: import, reset the peak, note the baseline, load, print the numbers as JSON."""
    for module in preload:
        importlib.import_module(module)
    module_name, _, function_name = function.partition(":")
    load: Callable[[Path, torch.dtype], object] = getattr(importlib.import_module(module_name), function_name)
    peak_reset = _reset_peak()
    baseline = _status_bytes("VmRSS")
    load(folder, getattr(torch, dtype))  # what it returns may go now: VmHWM keeps the peak
    peak = _status_bytes("VmHWM")
    print(json.dumps({"baseline_bytes": baseline, "peak_bytes": peak, "peak_reset": peak_reset}))


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS (Linux 4.0 and later)
        return True
    except OSError:
        return False


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    raise RuntimeError(f"/proc/self/status has no {key} (not Linux?)")


def make_sharded_llama(folder: Path, dtype: torch.dtype = torch.bfloat16, max_shard_size: str = "100MB") -> Path:
    """A randomly initialised Llama of about 155M parameters (untied head), saved by transformers in shards."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    torch.nn.Module.to(model, dtype)  # in place; transformers' own override of `to` has a signature mypy rejects
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


def default_cases(scratch: Path) -> list[tuple[Path, str]]:
    from modeling.model.store import ensure_default_model

    default = ensure_default_model()
    sharded = make_sharded_llama(scratch / "sharded-bf16")
    return [(default, "float32"), (default, "bfloat16"), (sharded, "bfloat16"), (sharded, "float32")]


def format_row(m: Measurement) -> str:
    files = WeightFiles(m.folder)
    file_dtypes = ",".join(sorted({str(files.dtype(n)).removeprefix("torch.") for n in files.names()}))
    mib = 1 << 20
    return (
        f"| {m.folder.name} | {file_dtypes} | {m.dtype} | {m.loader} | {m.weights_bytes / mib:.0f} | "
        f"{m.baseline_bytes / mib:.0f} | {(m.peak_bytes - m.baseline_bytes) / mib:.0f} | {m.ratio:.2f} |"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.load_memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--loader", default="engine", help="engine, reader-only, or MODULE:FUNCTION")
    parser.add_argument("--reader-only", action="store_true", help="the same as --loader reader-only")
    parser.add_argument("--folder", type=Path, help="measure this model folder (default: the cases above)")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], help="serving dtypes for --folder")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        folder, dtype, function, *preload = args.child
        _child(Path(folder), dtype, function, preload)
        return 0
    loader = "reader-only" if args.reader_only else args.loader
    with tempfile.TemporaryDirectory(prefix="load_memory_") as scratch:
        cases = [(args.folder, d) for d in args.dtype] if args.folder else default_cases(Path(scratch))
        print(
            "| model | file dtype | serving dtype | loader | weights MiB | baseline MiB | peak - baseline MiB | ratio |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for folder, dtype in cases:
            m = measure(folder, dtype, loader)
            print(format_row(m) + ("" if m.peak_reset else " (peak not reset: it covers the imports too)"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
