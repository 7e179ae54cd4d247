"""How many sequences run at once in a given KV memory: pages against whole-sequence slots.

Starts `specserve up` with a KV cache of exactly the memory `--slots` slots of
`--slot-len` positions took (the slot cache's default was 64 x 2048), sends
`--num-requests` requests of `--input-len` prompt tokens and `--output-len` completion
tokens all at once, and samples GetServerInfo while they run: the most sequences
running at once, and how many were preempted.

    python -m bench.capacity_bench
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
import torch

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.grpc_load import BenchError, RequestFactory, Workload, run_requests, split_results, summarize
from bench.local_stack import running_up
from bench.prompts import PromptWindows
from modeling.model.config import ModelConfig
from modeling.model.kv_cache import DEFAULT_PAGE_SIZE, page_bytes, pages_for_slots
from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc
from specserve.local_stack import StackError
from specserve.stack import free_ports
from modeling.model.engine import default_dtype


async def watch(stub: pb_grpc.SpecServeStub, peak: list[int], stop: asyncio.Event) -> None:
    """The most requests running at once, sampled every 0.2 s until `stop`."""
    while not stop.is_set():
        info = await stub.GetServerInfo(pb.ServerInfoRequest(), timeout=10)
        peak[0] = max(peak[0], info.num_running)
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except asyncio.TimeoutError:
            pass


async def run(
    address: str, prompts: PromptWindows, workload: Workload, num_requests: int
) -> tuple[int, pb.ServerInfoResponse, float, float]:
    requests = RequestFactory(prompts, workload.output_len, prefix=f"capacity-{os.getpid()}")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.SpecServeStub(channel)
        peak, stop = [0], asyncio.Event()
        watcher = asyncio.create_task(watch(stub, peak, stop))
        results, duration_s = await run_requests(stub, requests.take("all", num_requests), num_requests, workload)
        stop.set()
        await watcher
        summary = summarize(num_requests, split_results(results), duration_s)
        info = await stub.GetServerInfo(pb.ServerInfoRequest(), timeout=10)
    return peak[0], info, summary.output_tokens_per_s, duration_s


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.capacity_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--slot-len", type=int, default=2048)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    args = parser.parse_args(argv)
    from modeling.model.store import default_model_dir

    model = default_model_dir()
    dtype = args.dtype or default_dtype("cpu")
    memory = pages_for_slots(args.slots, args.slot_len) * page_bytes(
        ModelConfig.from_folder(model), DEFAULT_PAGE_SIZE, getattr(torch, dtype)
    )
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
        "--kv-cache-memory",
        f"{memory / 2**30:.6f}",
        "--max-num-seqs",
        str(args.num_requests),
    ]
    workload = Workload(args.input_len, args.output_len, args.num_requests, None, 3600.0)
    try:
        with running_up(flags) as stack:
            print(stack.ready_line, file=sys.stderr, flush=True)
            peak, info, tok_s, duration_s = asyncio.run(
                run(stack.address, PromptWindows.from_model_folder(model, args.input_len), workload, args.num_requests)
            )
    except (BenchError, StackError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    target = next(p for p in info.processes if p.role == "target")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; dtype {dtype}")
    print(
        f"KV cache: {memory / 2**30:.3f} GiB = {args.slots} slots x {args.slot_len} positions = {target.num_kv_pages} "
        f"pages of {target.kv_page_size}"
    )
    print(
        f"{args.num_requests} requests of {args.input_len} + {args.output_len} tokens: at most {peak} running at once, "
        f"{target.num_preemptions} preemptions, {tok_s:.1f} output tok/s, {duration_s:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
