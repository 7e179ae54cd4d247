"""Timed requests through the gRPC API:
a workload sent from concurrent clients, each request's latencies, a run's summary.

`bench.grpc_bench` (raw-text prompts at several concurrencies) and `bench.capacity_bench`
drive stacks with it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import grpc

from bench.prompts import PromptWindows
from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc


class BenchError(RuntimeError):
    """Ends the benchmark with this message and exit code 1."""


@dataclass(frozen=True)
class Workload:
    input_len: int  # prompt tokens per request
    output_len: int  # completion tokens per request (ignore_eos, so exactly this many)
    num_prompts: int | None  # requests per concurrency; None: max(8, 2 * concurrency)
    max_prompts: int | None  # cap on the default above
    request_timeout_s: float

    def num_requests(self, concurrency: int) -> int:
        if self.num_prompts is not None:
            return self.num_prompts
        default = max(8, 2 * concurrency)
        return default if self.max_prompts is None else min(default, self.max_prompts)


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    ttft_s: float  # request sent -> first chunk with tokens
    itls_s: tuple[float, ...]  # one per token after the first chunk: gap since the previous chunk / tokens in the chunk
    e2e_s: float  # request sent -> stream closed
    num_output_tokens: int  # token ids over all chunks


@dataclass(frozen=True)
class RequestFailure:
    request_id: str
    reason: str


@dataclass(frozen=True)
class RunSummary:
    concurrency: int
    num_requests: int
    duration_s: float
    num_output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    e2e_p50_s: float


def build_request(request_id: str, prompt_token_ids: list[int], output_len: int) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_token_ids), params=params, request_id=request_id)


async def timed_generate(
    stub: pb_grpc.SpecServeStub, request: pb.GenerateRequest, timeout_s: float
) -> RequestRecord | RequestFailure:
    """Stream one request, noting when each chunk with tokens arrived and how many it carried."""
    arrivals: list[tuple[float, int]] = []  # (perf_counter seconds, tokens in the chunk)
    start_s = time.perf_counter()
    try:
        async for chunk in stub.Generate(request, timeout=timeout_s):
            if chunk.token_ids:
                arrivals.append((time.perf_counter(), len(chunk.token_ids)))
    except grpc.aio.AioRpcError as error:
        return RequestFailure(request.request_id, f"{error.code().name}: {error.details()}")
    end_s = time.perf_counter()
    if not arrivals:
        return RequestFailure(request.request_id, "the stream ended without a token")
    return RequestRecord(
        request_id=request.request_id,
        ttft_s=arrivals[0][0] - start_s,
        itls_s=inter_token_latencies_s(arrivals),
        e2e_s=end_s - start_s,
        num_output_tokens=sum(num_tokens for _, num_tokens in arrivals),
    )


def inter_token_latencies_s(arrivals: Sequence[tuple[float, int]]) -> tuple[float, ...]:
    """Each chunk after the first spreads the gap since the previous chunk evenly over its tokens."""
    itls_s: list[float] = []
    for (previous_s, _), (arrival_s, num_tokens) in pairwise(arrivals):
        itls_s.extend([(arrival_s - previous_s) / num_tokens] * num_tokens)
    return tuple(itls_s)


def check_length(result: RequestRecord | RequestFailure, output_len: int) -> RequestRecord | RequestFailure:
    if isinstance(result, RequestRecord) and result.num_output_tokens != output_len:
        return RequestFailure(result.request_id, f"got {result.num_output_tokens} tokens, expected {output_len}")
    return result


async def run_requests(
    stub: pb_grpc.SpecServeStub, requests: list[pb.GenerateRequest], concurrency: int, workload: Workload
) -> tuple[list[RequestRecord | RequestFailure], float]:
    """Send the requests with at most `concurrency` in flight; returns the results and the run's wall time."""
    pending = iter(requests)  # shared by the clients: each takes the next request when its last one is done
    results: list[RequestRecord | RequestFailure] = []

    async def client() -> None:
        for request in pending:
            result = await timed_generate(stub, request, workload.request_timeout_s)
            results.append(check_length(result, workload.output_len))

    start_s = time.perf_counter()
    async with asyncio.TaskGroup() as clients:
        for i in range(min(concurrency, len(requests))):
            clients.create_task(client(), name=f"bench-client-{i}")
    return results, time.perf_counter() - start_s


def summarize(concurrency: int, records: list[RequestRecord], duration_s: float) -> RunSummary:
    num_output_tokens = sum(r.num_output_tokens for r in records)
    ttfts_s = [r.ttft_s for r in records]
    itls_s = [itl for r in records for itl in r.itls_s]
    return RunSummary(
        concurrency=concurrency,
        num_requests=len(records),
        duration_s=duration_s,
        num_output_tokens=num_output_tokens,
        output_tokens_per_s=num_output_tokens / duration_s,
        requests_per_s=len(records) / duration_s,
        ttft_p50_ms=1000 * percentile(ttfts_s, 50),
        ttft_p99_ms=1000 * percentile(ttfts_s, 99),
        itl_p50_ms=1000 * percentile(itls_s, 50),
        itl_p99_ms=1000 * percentile(itls_s, 99),
        e2e_p50_s=percentile([r.e2e_s for r in records], 50),
    )


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default); NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = (len(ordered) - 1) * q / 100
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def split_results(results: list[RequestRecord | RequestFailure]) -> list[RequestRecord]:
    """The records, or BenchError naming the failures."""
    failures = [r for r in results if isinstance(r, RequestFailure)]
    if failures:
        shown = "\n".join(f"  {f.request_id}: {f.reason}" for f in failures[:5])
        raise BenchError(f"{len(failures)} of {len(results)} requests failed:\n{shown}")
    return [r for r in results if isinstance(r, RequestRecord)]


class RequestFactory:
    """Hands out requests whose prompts are successive windows, so no two requests of a benchmark share a prompt."""

    def __init__(self, prompts: PromptWindows, output_len: int, prefix: str) -> None:
        self._prompts = prompts
        self._output_len = output_len
        self._prefix = prefix
        self._num_taken = 0

    def take(self, label: str, num_requests: int) -> list[pb.GenerateRequest]:
        first = self._num_taken
        self._num_taken += num_requests
        return [
            build_request(f"{self._prefix}-{label}-{i}", self._prompts.prompt_token_ids(first + i), self._output_len)
            for i in range(num_requests)
        ]
