"""Plain decoding of one model through specserve and vLLM's CPU build, measured by vLLM's own client.

Random prompts of 128 tokens, 128 output tokens each (EOS ignored), greedy, at each
concurrency; specserve without speculation (`--draft none`), so the figures compare the
two engines' decode loops on the same model folder. Each server is started, measured and
stopped in turn, so the figures come from one run on one machine. vLLM is measured when
`--vllm` names its CLI and it can load the folder (`../shared/bench-clients.md` says how to
install its CPU build); `--servers specserve` skips it.

    python -m bench.decode_bench --vllm /tmp/vllmenv/bin/vllm --model gemma3-270m --concurrency 1 16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.prefix_bench import vllm_env, specserve_server, vllm_server
from specserve.local_stack import StackError

SERVERS = ("specserve", "vllm")


@dataclass(frozen=True)
class Figures:
    server: str
    concurrency: int
    output_tok_s: float
    ttft_p50_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    completed: int


def workload_args(args: argparse.Namespace, concurrency: int) -> list[str]:
    return [
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(max(8, 2 * concurrency)),
        "--max-concurrency",
        str(concurrency),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(args.seed),
    ]


def measure(server: str, base_url: str, args: argparse.Namespace, concurrency: int, work_dir: Path) -> Figures:
    result = work_dir / f"{server}-{concurrency}.json"
    command = [
        args.vllm,
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        args.folder.name,
        "--tokenizer",
        str(args.folder),
        *workload_args(args, concurrency),
        "--save-result",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
    ]
    print(f"{server}: {shlex.join(command)}", file=sys.stderr, flush=True)
    subprocess.run(command, check=True, env=vllm_env(), stdout=sys.stderr)
    data = json.loads(result.read_text())
    return Figures(
        server,
        concurrency,
        data["output_throughput"],
        data["median_ttft_ms"],
        data["median_itl_ms"],
        data["p99_itl_ms"],
        data["completed"],
    )


def format_table(figures: Sequence[Figures]) -> str:
    rows = [
        "| server | concurrency | output tok/s | TTFT p50 (ms) | ITL p50 (ms) | ITL p99 (ms) | completed |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows += [
        f"| {f.server} | {f.concurrency} | {f.output_tok_s:.1f} | {f.ttft_p50_ms:.0f} | {f.itl_p50_ms:.1f} | "
        f"{f.itl_p99_ms:.1f} | {f.completed} |"
        for f in figures
    ]
    return "\n".join(rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.decode_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--vllm", required=True, help="vLLM's CLI (`vllm`): the client for every server, and the peer server"
    )
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument(
        "--model",
        default=None,
        help="a registered model name, a .gguf file or a folder (default: the embedded default model)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="for every server (default: specserve's on this machine)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from modeling.model.engine import default_dtype
    from specserve.up import UpRefused, resolve_model

    try:
        args.folder = resolve_model(args.model)  # converted once into the cache when it is a name or a GGUF file
    except UpRefused as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    args.dtype = args.dtype or default_dtype("cpu")
    work_dir = Path(tempfile.mkdtemp(prefix="specserve-decode-bench-"))
    figures: list[Figures] = []
    try:
        for server in args.servers:
            if server == "vllm":
                context = vllm_server(args.vllm, args.folder, args.dtype, work_dir, served_name=args.folder.name)
            else:
                context = specserve_server(args.folder, args.dtype, prefix_cache=True, num_workers=1)
            with context as base_url:
                for concurrency in args.concurrency:
                    figures.append(measure(server, base_url, args, concurrency, work_dir))
    except (StackError, subprocess.CalledProcessError) as error:
        print(f"error: {error} (logs in {work_dir})", file=sys.stderr)
        print(format_table(figures))
        return 1
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; model {args.folder.name}; "
        f"dtype {args.dtype}; random prompts of {args.input_len} tokens, {args.output_len} output tokens, greedy, "
        "num-prompts max(8, 2 x concurrency)"
    )
    print(format_table(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
