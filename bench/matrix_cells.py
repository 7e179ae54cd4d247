"""The matrix's cells: a workload's prompts sent at one concurrency to one stack, and a round of cells over every stack.

A cell's result is its completion tokens per second, its outputs, and what the stack's
speculation counters moved by (`bench.speculation_counters`); `bench.matrix_tables`
compares cells with the first configuration's.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from bench.spec_prompts import JSON_BY_SCHEMA, WORKLOADS
from bench.speculation_counters import SpeculationDelta, read_steps_by_k, speculation_delta, steps_delta
from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc

JSON_WORKLOAD = "json"
ALL_WORKLOADS = (*WORKLOADS, JSON_WORKLOAD)
REQUEST_TIMEOUT_S = 600.0
SERVER_INFO_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class PromptSet:
    """One workload's prompts, chat-templated to token ids, and each one's JSON schema (as text) or None."""

    name: str
    prompts: list[list[int]]
    schemas: list[str | None]

    def request(self, index: int, output_len: int) -> pb.GenerateRequest:
        """Greedy and ignoring end-of-sequence, so every output is `output_len` tokens
        unless a grammar completes first."""
        params = pb.SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        schema = self.schemas[index]
        if schema is not None:
            params.structured_output.json_schema = schema
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=self.prompts[index]), params=params)


@dataclass(frozen=True)
class CellResult:
    config: str
    workload: str
    concurrency: int
    round: int
    num_requests: int
    num_output_tokens: int
    duration_s: float
    tokens_per_s: float
    speculation: SpeculationDelta
    steps_by_k: dict[int, int] | None  # None: /metrics could not be read
    outputs: list[list[int]] = field(repr=False)  # request i's completion token ids


def requests_in_cell(concurrency: int, num_prompts: int, requests_per_cell: int | None) -> int:
    """Every prompt equally often and twice the clients at least, so that the last, partly idle wave is a small part.

    With `requests_per_cell`, that many, but at least one per client.
    """
    if requests_per_cell is not None:
        return max(requests_per_cell, concurrency)
    wanted = max(2 * concurrency, num_prompts)
    return -(-wanted // num_prompts) * num_prompts


async def _generate(stub: pb_grpc.SpecServeStub, request: pb.GenerateRequest) -> list[int]:
    tokens: list[int] = []
    async for chunk in stub.Generate(request, timeout=REQUEST_TIMEOUT_S):
        tokens.extend(chunk.token_ids)
    return tokens


async def _send_all(
    stub: pb_grpc.SpecServeStub, requests: Sequence[pb.GenerateRequest], concurrency: int
) -> tuple[list[list[int]], float]:
    """The requests from `concurrency` clients (as bench/grpc_load.py's run_requests); outputs in request order."""
    outputs: list[list[int]] = [[] for _ in requests]
    pending = iter(enumerate(requests))  # shared by the clients: each takes the next request when its last one is done

    async def client() -> None:
        for index, request in pending:
            outputs[index] = await _generate(stub, request)

    started = time.perf_counter()
    async with asyncio.TaskGroup() as clients:
        for i in range(min(concurrency, len(requests))):
            clients.create_task(client(), name=f"matrix-client-{i}")
    return outputs, time.perf_counter() - started


@dataclass(frozen=True)
class _Served:
    """One configuration's stack in a round."""

    label: str  # the configuration, numbered where it is given more than once
    stub: pb_grpc.SpecServeStub
    metrics_url: str


async def _warm_up(stack: _Served, prompt_set: PromptSet) -> None:
    """Prefill every prompt (and compile every grammar) once: each cell then finds its prompts in the prefix cache,
    whichever configuration and concurrency comes first, and measures decoding."""
    warm_up = [prompt_set.request(i, 1) for i in range(len(prompt_set.prompts))]
    await _send_all(stack.stub, warm_up, len(warm_up))


async def _run_cell(
    stack: _Served,
    prompt_set: PromptSet,
    concurrency: int,
    output_len: int,
    requests_per_cell: int | None,
    round_index: int,
) -> CellResult:
    num_requests = requests_in_cell(concurrency, len(prompt_set.prompts), requests_per_cell)
    requests = [prompt_set.request(i % len(prompt_set.prompts), output_len) for i in range(num_requests)]
    before = (await stack.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=SERVER_INFO_TIMEOUT_S)).speculation
    steps_before = await asyncio.to_thread(read_steps_by_k, stack.metrics_url, SERVER_INFO_TIMEOUT_S)
    outputs, duration_s = await _send_all(stack.stub, requests, concurrency)
    after = (await stack.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=SERVER_INFO_TIMEOUT_S)).speculation
    steps_after = await asyncio.to_thread(read_steps_by_k, stack.metrics_url, SERVER_INFO_TIMEOUT_S)
    num_tokens = sum(len(o) for o in outputs)
    result = CellResult(
        config=stack.label,
        workload=prompt_set.name,
        concurrency=concurrency,
        round=round_index,
        num_requests=num_requests,
        num_output_tokens=num_tokens,
        duration_s=duration_s,
        tokens_per_s=num_tokens / duration_s,
        speculation=speculation_delta(before, after),
        steps_by_k=steps_delta(steps_before, steps_after),
        outputs=outputs,
    )
    print(
        f"  {stack.label:>20} {prompt_set.name:>8} c={concurrency:<3}: {result.tokens_per_s:7.1f} tok/s "
        f"({num_requests} requests, {duration_s:5.1f} s), acceptance {result.speculation.acceptance_rate:.2f}",
        file=sys.stderr,
        flush=True,
    )
    return result


async def run_round(
    served: Sequence[tuple[str, str, str]],
    prompt_sets: Sequence[PromptSet],
    concurrencies: Sequence[int],
    output_len: int,
    requests_per_cell: int | None,
    round_index: int,
) -> tuple[list[CellResult], list[pb.ServerInfoResponse]]:
    """Every cell of one round, each run on every stack in turn ((label, gRPC address, metrics URL) per stack), the
    order of the stacks rotated from cell to cell and round to round, so that a cell's ratios compare runs seconds
    apart and no configuration always runs first."""
    channels = [grpc.aio.insecure_channel(address) for _, address, _ in served]
    try:
        stacks = [
            _Served(label, pb_grpc.SpecServeStub(channel), metrics_url)
            for (label, _, metrics_url), channel in zip(served, channels)
        ]
        for stack in stacks:
            await _generate(
                stack.stub,
                pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=[1, 2, 3]), params=pb.SamplingParams(max_tokens=8, ignore_eos=True)
                ),
            )
        results = []
        turn = round_index
        for prompt_set in prompt_sets:
            for stack in stacks:
                await _warm_up(stack, prompt_set)
            for concurrency in concurrencies:
                for offset in range(len(stacks)):
                    stack = stacks[(turn + offset) % len(stacks)]
                    results.append(
                        await _run_cell(stack, prompt_set, concurrency, output_len, requests_per_cell, round_index)
                    )
                turn += 1
        infos = [
            await stack.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=SERVER_INFO_TIMEOUT_S) for stack in stacks
        ]
        return results, infos
    finally:
        for channel in channels:
            await channel.close()


def load_prompt_sets(workloads: Sequence[str]) -> list[PromptSet]:
    """Every prompt as one user message through the model's chat template, as bench/spec_bench.py sends them."""
    from modeling.model.store import default_model_dir
    from common.text.tokenizer import ChatMessage, Tokenizer

    tokenizer = Tokenizer.load(default_model_dir())
    sets = []
    for name in workloads:
        if name == JSON_WORKLOAD:
            texts = [p.text for p in JSON_BY_SCHEMA]
            schemas: list[str | None] = [json.dumps(p.schema) for p in JSON_BY_SCHEMA]
        else:
            texts = WORKLOADS[name]
            schemas = [None] * len(texts)
        sets.append(PromptSet(name, [tokenizer.encode_chat([ChatMessage("user", text)]) for text in texts], schemas))
    return sets
