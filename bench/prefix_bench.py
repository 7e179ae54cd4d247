"""Shared-prefix serving, measured by vLLM's own client against specserve (with and without its prefix cache) and vLLM.

The workload is vLLM's `prefix_repetition` dataset: a few long prefixes, each request one
of them plus a short suffix of its own (an application's system prompt, a chat's
history). Every server is started, measured with the same `vllm bench serve` command
line through the OpenAI HTTP API, and stopped, one after another, so the figures come
from one run on one machine. vLLM is measured when `--vllm` names its CLI
(`../shared/bench-clients.md` says how to install its CPU build).

    python -m bench.prefix_bench --vllm /tmp/vllmenv/bin/vllm
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.local_stack import running_up
from specserve.local_stack import StackError
from specserve.stack import free_port, free_ports

SERVED_NAME = "SmolLM2-135M-Instruct"
SERVERS = ("specserve", "specserve-no-prefix-cache", "vllm")


@dataclass(frozen=True)
class Figures:
    server: str
    ttft_p50_ms: float
    ttft_p99_ms: float
    output_tok_s: float
    completed: int
    hit_share: float | None  # prompt tokens found in specserve's prefix cache / looked up (None: not specserve)


def workload_args(args: argparse.Namespace) -> list[str]:
    return [
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        str(args.prefix_len),
        "--prefix-repetition-suffix-len",
        str(args.suffix_len),
        "--prefix-repetition-num-prefixes",
        str(args.num_prefixes),
        "--prefix-repetition-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(args.concurrency),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(args.seed),
    ]


def client_command(vllm: str, base_url: str, model: Path, args: argparse.Namespace, result: Path) -> list[str]:
    return [
        vllm,
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        SERVED_NAME,
        "--tokenizer",
        str(model),
        *workload_args(args),
        "--save-result",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
    ]


def measure(server: str, base_url: str, model: Path, args: argparse.Namespace, work_dir: Path) -> Figures:
    result = work_dir / f"{server}.json"
    command = client_command(args.vllm, base_url, model, args, result)
    print(f"{server}: {shlex.join(command)}", file=sys.stderr, flush=True)
    subprocess.run(command, check=True, env=vllm_env(), stdout=sys.stderr)
    data = json.loads(result.read_text())
    return Figures(
        server,
        data["median_ttft_ms"],
        data["p99_ttft_ms"],
        data["output_throughput"],
        data["completed"],
        None if server == "vllm" else _hit_share(base_url),
    )


def _hit_share(base_url: str) -> float:
    """From specserve's /metrics: prompt tokens its prefix caches held / prompt tokens looked up, all workers."""
    host, port = base_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("GET", "/metrics")
    totals = {"hit": 0.0, "queried": 0.0}
    for line in connection.getresponse().read().decode().splitlines():
        for kind in totals:
            if line.startswith(f"specserve_prefix_cache_{kind}_tokens_total{{"):
                totals[kind] += float(line.rsplit(" ", 1)[1])
    return totals["hit"] / totals["queried"] if totals["queried"] else 0.0


@contextmanager
def specserve_server(model: Path | str, dtype: str, prefix_cache: bool, num_workers: int) -> Iterator[str]:
    grpc_port, http_port = free_ports(2)
    flags = [
        "--model",
        str(model),
        "--dtype",
        dtype,
        "--draft",
        "none",
        "--port",
        str(grpc_port),
        "--http-port",
        str(http_port),
        "--num-workers",
        str(num_workers),
        *([] if prefix_cache else ["--no-prefix-cache"]),
    ]
    print(f"starting: specserve up {shlex.join(flags)}", file=sys.stderr, flush=True)
    with running_up(flags) as stack:
        print(stack.ready_line, file=sys.stderr, flush=True)
        yield f"http://127.0.0.1:{http_port}"


@contextmanager
def vllm_server(vllm: str, model: Path, dtype: str, log_dir: Path, served_name: str = SERVED_NAME) -> Iterator[str]:
    port = free_port()
    command = [
        vllm,
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        "2048",
        "--served-model-name",
        served_name,
    ]
    with served(command, port, log_dir / "vllm.log", vllm_env()):
        yield f"http://127.0.0.1:{port}"


@contextmanager
def served(command: list[str], port: int, log: Path, env: dict[str, str]) -> Iterator[None]:
    """A server `command` listening on `port` (its output in `log`),
    from its first 200 on /health to the block's end."""
    print(f"starting: {shlex.join(command)}", file=sys.stderr, flush=True)
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            _wait_healthy(port, process, timeout_s=600)
            yield
        finally:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def vllm_env() -> dict[str, str]:
    """vLLM's CPU build on both cores, offline."""
    return {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    }


def _wait_healthy(port: int, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise StackError(f"vllm serve exited with {process.returncode} before it served")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(2)
    raise StackError(f"vllm serve did not answer /health within {timeout_s:g} s")


def format_table(figures: Sequence[Figures]) -> str:
    rows = [
        "| server | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s | completed | prompt tokens cached |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows += [
        f"| {f.server} | {f.ttft_p50_ms:.0f} | {f.ttft_p99_ms:.0f} | {f.output_tok_s:.1f} | {f.completed} | "
        f"{'-' if f.hit_share is None else f'{f.hit_share:.0%}'} |"
        for f in figures
    ]
    return "\n".join(rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.prefix_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--vllm", required=True, help="vLLM's CLI (`vllm`): the client for every server, and the peer server"
    )
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--model", type=Path, default=None, help="default: the embedded default model")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="for every server (default: specserve's on this machine)",
    )
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-workers", type=int, default=1, help="specserve's data-parallel target workers")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model is None:
        from modeling.model.store import default_model_dir

        args.model = default_model_dir()
    if args.dtype is None:
        from modeling.model.engine import default_dtype

        args.dtype = default_dtype("cpu")
    work_dir = Path(tempfile.mkdtemp(prefix="specserve-prefix-bench-"))
    figures: list[Figures] = []
    try:
        for server in args.servers:
            if server == "vllm":
                context = vllm_server(args.vllm, args.model, args.dtype, work_dir)
            else:
                context = specserve_server(
                    args.model, args.dtype, prefix_cache=server == "specserve", num_workers=args.num_workers
                )
            with context as base_url:
                figures.append(measure(server, base_url, args.model, args, work_dir))
    except (StackError, subprocess.CalledProcessError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; dtype {args.dtype}; "
        f"workload: {shlex.join(workload_args(args))}"
    )
    print(format_table(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
