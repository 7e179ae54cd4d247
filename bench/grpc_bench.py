"""Benchmark a specserve stack through its gRPC API:
real-text prompts of fixed length, greedy, at several concurrencies."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import grpc

if not __package__:
    # Run as a file (`python bench/grpc_bench.py`, as `make bench` does): make the repository root importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.grpc_load import BenchError, RequestFactory, RunSummary, Workload, run_requests, split_results, summarize
from bench.local_stack import ReadyStack, running_up
from bench.machine_info import describe_machine
from bench.prompts import PromptWindows
from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc
from proto.lifecycle import State
from specserve.local_stack import StackError
from specserve.stack import free_ports
from common.quantization import QUANTIZATIONS

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_CONCURRENCIES = (1, 4, 16, 64)
NUM_WARMUP_REQUESTS = 2
SERVER_INFO_TIMEOUT_S = 10.0


# ---------------------------------------------------------------- the benchmark


async def fetch_server_info(stub: pb_grpc.SpecServeStub, address: str) -> pb.ServerInfoResponse:
    try:
        info: pb.ServerInfoResponse = await stub.GetServerInfo(pb.ServerInfoRequest(), timeout=SERVER_INFO_TIMEOUT_S)
    except grpc.aio.AioRpcError as error:
        raise BenchError(
            f"no specserve gateway answers at {address} ({error.code().name}: {error.details()}); "
            f"start one with `specserve up`, or pass --start"
        ) from error
    return info


def check_server(info: pb.ServerInfoResponse, workload: Workload) -> None:
    if not any(p.role == "target" and p.state == State.READY for p in info.processes):
        raise BenchError(f"the stack has no READY target worker: {[(p.process_id, p.state) for p in info.processes]}")
    if workload.input_len + workload.output_len > info.max_model_len:
        raise BenchError(
            f"--input-len + --output-len = {workload.input_len + workload.output_len} exceeds the "
            f"server's max_model_len {info.max_model_len}"
        )


async def benchmark(
    address: str, prompts: PromptWindows, concurrencies: Sequence[int], workload: Workload
) -> tuple[pb.ServerInfoResponse, list[RunSummary]]:
    """Warm up, then one run per concurrency; every request gets a prompt window no other request had."""
    requests = RequestFactory(prompts, workload.output_len, prefix=f"bench-{os.getpid()}")
    summaries: list[RunSummary] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.SpecServeStub(channel)
        info = await fetch_server_info(stub, address)
        check_server(info, workload)
        warmup = requests.take("warmup", NUM_WARMUP_REQUESTS)
        split_results((await run_requests(stub, warmup, NUM_WARMUP_REQUESTS, workload))[0])
        for concurrency in concurrencies:
            measured = requests.take(f"c{concurrency}", workload.num_requests(concurrency))
            results, duration_s = await run_requests(stub, measured, concurrency, workload)
            summaries.append(summarize(concurrency, split_results(results), duration_s))
            print(
                f"concurrency {concurrency}: {len(measured)} requests in {duration_s:.1f} s, "
                f"{summaries[-1].output_tokens_per_s:.1f} output tok/s",
                file=sys.stderr,
                flush=True,
            )
    return info, summaries


# ---------------------------------------------------------------- report


def format_table(summaries: Sequence[RunSummary]) -> str:
    header = (
        "| concurrency | requests | output tok/s | req/s | TTFT p50 (ms) | TTFT p99 (ms) "
        "| ITL p50 (ms) | ITL p99 (ms) | E2E p50 (s) |"
    )
    rows = [header, "|" + "---:|" * 9]
    for s in summaries:
        figures = (
            s.output_tokens_per_s,
            s.requests_per_s,
            s.ttft_p50_ms,
            s.ttft_p99_ms,
            s.itl_p50_ms,
            s.itl_p99_ms,
            s.e2e_p50_s,
        )
        precisions = (1, 2, 1, 1, 1, 1, 2)
        cells = [str(s.concurrency), str(s.num_requests)] + [_number(v, p) for v, p in zip(figures, precisions)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _number(value: float, precision: int) -> str:
    return "-" if math.isnan(value) else f"{value:.{precision}f}"


def describe_server(address: str, info: pb.ServerInfoResponse) -> dict[str, Any]:
    return {
        "address": address,
        "model_name": info.model_name,
        "max_model_len": info.max_model_len,
        "processes": [
            {"process_id": p.process_id, "role": p.role, "num_kv_pages": p.num_kv_pages, "kv_page_size": p.kv_page_size}
            for p in info.processes
        ],
    }


def build_report(
    args: argparse.Namespace,
    address: str,
    stack: ReadyStack | None,
    info: pb.ServerInfoResponse,
    summaries: Sequence[RunSummary],
) -> dict[str, Any]:
    dtype = args.dtype or (stack.dtype if stack else None)
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv),
        "machine": describe_machine(dtype, stack.device if stack else None),
        "server": describe_server(address, info) | {"started_by_bench": stack is not None},
        "workload": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "prompts": "windows of an English essay (bench/prompts.py), as token_ids",
            "num_warmup_requests": NUM_WARMUP_REQUESTS,
        },
        "runs": [
            {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(s).items()}
            for s in summaries
        ],
    }


# ---------------------------------------------------------------- command line


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_bench", description=__doc__)
    target = parser.add_mutually_exclusive_group()
    target.add_argument(
        "--address", default=DEFAULT_ADDRESS, help=f"a running gateway, HOST:PORT (default {DEFAULT_ADDRESS})"
    )
    target.add_argument(
        "--start",
        action="store_true",
        help="start the stack `specserve up` would (same flags, same defaults), stop it at the end",
    )
    stack = parser.add_argument_group("with --start")
    stack.add_argument("--port", type=positive_int, default=None, help="the stack's gRPC port (default: a free one)")
    stack.add_argument("--num-workers", type=positive_int, default=None)
    stack.add_argument("--kv-cache-memory", type=float, default=None, help="GiB of KV cache per worker (default: up's)")
    stack.add_argument(
        "--max-num-seqs", type=positive_int, default=None, help="sequences each worker runs at once at most"
    )
    stack.add_argument("--no-prefix-cache", action="store_true", help="the stack computes every prompt in full")
    stack.add_argument("--ready-timeout-s", type=float, default=600.0)
    stack.add_argument(
        "--draft",
        default=None,
        help="the stack's draft service: none, ngram, default, phrases:PATH, eagle:PATH, eagle+ngram:PATH, "
        "eagle+phrases:PATH or model:PATH (default: up's)",
    )
    stack.add_argument("--num-speculative-tokens", type=int, default=None)
    stack.add_argument("--spec-disable-batch-threshold", type=int, default=None)
    stack.add_argument("--spec-draft-token-budget", type=int, default=None)
    stack.add_argument("--no-token-trees", action="store_true", help="the draft proposes chains, not token trees")
    stack.add_argument("--quantization", choices=("auto", *QUANTIZATIONS), default=None, help="up's (default: auto)")
    stack.add_argument(
        "--insecure-loopback",
        action="store_true",
        help="the services' sockets without CurveZMQ keys (to measure what authentication costs)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="passed to `specserve up` with --start; otherwise only recorded in the JSON",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="the model folder whose tokenizer makes the prompts (default: the embedded default model); "
        "passed to `specserve up` with --start",
    )
    parser.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=positive_int, default=128, help="completion tokens per request")
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        nargs="+",
        default=list(DEFAULT_CONCURRENCIES),
        help="requests in flight at most, one run each",
    )
    parser.add_argument(
        "--num-prompts", type=positive_int, default=None, help="requests per run (default: max(8, 2 * concurrency))"
    )
    parser.add_argument("--max-prompts", type=positive_int, default=None, help="cap on the default --num-prompts")
    parser.add_argument("--request-timeout-s", type=float, default=1800.0)
    parser.add_argument("--json-out", type=Path, default=None, help="also write the figures, machine and command here")
    args = parser.parse_args(argv)
    if not args.start:
        given = [
            flag
            for flag, value in (
                ("--port", args.port),
                ("--num-workers", args.num_workers),
                ("--kv-cache-memory", args.kv_cache_memory),
                ("--max-num-seqs", args.max_num_seqs),
            )
            if value is not None
        ]
        if given:
            parser.error(f"{', '.join(given)} need --start")
    return args


def model_dir(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return Path(args.model)
    from modeling.model.store import default_model_dir  # imported here: it pulls in numpy and gguf

    return default_model_dir()


def up_flags(args: argparse.Namespace) -> list[str]:
    """The `specserve up` flags of the stack --start runs: the given options, free ports for the rest."""
    optional = {
        "--model": args.model,
        "--dtype": args.dtype,
        "--quantization": args.quantization,
        "--num-workers": args.num_workers,
        "--kv-cache-memory": args.kv_cache_memory,
        "--max-num-seqs": args.max_num_seqs,
        "--draft": args.draft,
        "--num-speculative-tokens": args.num_speculative_tokens,
        "--spec-disable-batch-threshold": args.spec_disable_batch_threshold,
        "--spec-draft-token-budget": args.spec_draft_token_budget,
    }
    given = [part for flag, value in optional.items() if value is not None for part in (flag, str(value))]
    grpc_port, http_port = free_ports(2, taken=[args.port] if args.port else [])
    return [
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port or grpc_port),
        "--http-port",
        str(http_port),
        "--ready-timeout-s",
        str(args.ready_timeout_s),
        *given,
        *(["--no-token-trees"] if args.no_token_trees else []),
        *(["--no-prefix-cache"] if args.no_prefix_cache else []),
        *(["--insecure-loopback"] if args.insecure_loopback else []),
    ]


def run(args: argparse.Namespace) -> tuple[list[RunSummary], dict[str, Any]]:
    """The whole benchmark, stack included; returns the figures and the report for --json-out."""
    workload = Workload(
        input_len=args.input_len,
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        max_prompts=args.max_prompts,
        request_timeout_s=args.request_timeout_s,
    )
    try:
        prompts = PromptWindows.from_model_folder(model_dir(args), args.input_len)
    except FileNotFoundError as error:
        raise BenchError(str(error)) from error
    if not args.start:
        info, summaries = asyncio.run(benchmark(args.address, prompts, args.concurrency, workload))
        return summaries, build_report(args, args.address, None, info, summaries)
    flags = up_flags(args)
    print(f"starting: specserve up {shlex.join(flags)}", file=sys.stderr, flush=True)
    with running_up(flags) as stack:
        print(f"{stack.ready_line} (logs: {stack.log_dir})", file=sys.stderr, flush=True)
        info, summaries = asyncio.run(benchmark(stack.address, prompts, args.concurrency, workload))
    return summaries, build_report(args, stack.address, stack, info, summaries)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        summaries, report = run(args)
    except (BenchError, StackError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(format_table(summaries))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
