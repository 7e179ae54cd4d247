"""Speculative decoding against plain decoding as a matrix: draft configurations x workloads x concurrencies.

For each stack configuration (`specserve up --draft none`, `--draft ngram`, `--draft default`)
it sends, for each workload (chat, code, editing: bench/spec_prompts.py's WORKLOADS; json:
its JSON_BY_SCHEMA, sent with the schema as structured output, so the tokens the grammar
forces are verified as drafts) and each concurrency c, a fixed set of greedy requests of at
most `--output-len` tokens from c clients at once, each client taking the next request when
its last one is done. A cell's figure is its completion tokens per second (all its tokens
over its wall time) as a ratio to the first configuration's (none) in the same cell and
round. It also counts the outputs that are not token-identical to the first configuration's
in the same cell, and the cell's acceptance (GetServerInfo's speculation counters, before
and after) and the k the scheduler chose per target step (/metrics, before and after).

Speculation pays differently by workload (what prompt lookup finds to copy) and by batch
size (a verify pass costs more once the target is no longer bound by reading its weights;
past --spec-disable-batch-threshold the stack does not speculate at all), so one number
per configuration hides where it helps and where it costs.

Every configuration's stack is up at once (started afresh each round, one after another), and
each cell runs on all of them in turn before the next cell, the order rotated from cell to
cell: on a shared machine the plain speed drifts by 5-15% within minutes, so a ratio compares
runs seconds apart. An idle stack costs the one running a few wake-ups a second. With
`--rounds N` each ratio is the median of its N rounds' ratios. Giving a configuration twice
(`--config none --config none`) measures how far a ratio moves by noise alone.

    python bench/spec_matrix.py [--config none --config ngram --config default] [--rounds 3] \\
        [--concurrency 1 --concurrency 4 ...] [--extra-up-args "--dtype bfloat16"] [--json-out matrix.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.grpc_bench import DEFAULT_CONCURRENCIES, describe_machine
from bench.local_stack import running_up
from bench.spec_prompts import JSON_BY_SCHEMA, WORKLOADS
from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc
from specserve.stack import StackError, free_ports

JSON_WORKLOAD = "json"
ALL_WORKLOADS = (*WORKLOADS, JSON_WORKLOAD)
DEFAULT_CONFIGS = ("none", "ngram", "default")
REQUEST_TIMEOUT_S = 600.0
SERVER_INFO_TIMEOUT_S = 10.0
STEPS_BY_K_METRIC = "specserve_speculation_decisions"  # /metrics: target steps by the k chosen (0: decoded plainly)


@dataclass(frozen=True)
class PromptSet:
    """One workload's prompts, chat-templated to token ids, and each one's JSON schema (as text) or None."""

    name: str
    prompts: list[list[int]]
    schemas: list[str | None]

    def request(self, index: int, output_len: int) -> pb.GenerateRequest:
        """Greedy and ignoring end-of-sequence, so every output is `output_len` tokens unless a grammar completes first."""
        params = pb.SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        schema = self.schemas[index]
        if schema is not None:
            params.structured_output.json_schema = schema
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=self.prompts[index]), params=params)


@dataclass(frozen=True)
class SpeculationDelta:
    """What the server's speculation counters moved by over one cell."""

    num_draft_tokens: int
    num_accepted_draft_tokens: int
    num_verify_steps: int
    num_plain_decode_steps: int
    by_source: dict[str, tuple[int, int]]  # source -> (draft tokens, accepted draft tokens)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.num_accepted_draft_tokens / self.num_verify_steps if self.num_verify_steps else 0.0


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


KV_CACHE_GIB = 2  # per stack unless --extra-up-args says: ample for 64 clients, and the same for every configuration


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


async def _send_all(stub: pb_grpc.SpecServeStub, requests: Sequence[pb.GenerateRequest],
                    concurrency: int) -> tuple[list[list[int]], float]:
    """The requests from `concurrency` clients (as bench/grpc_bench.py's run_requests); outputs in request order."""
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


def _speculation_delta(before: pb.Speculation, after: pb.Speculation) -> SpeculationDelta:
    earlier = {s.source: s for s in before.sources}
    by_source = {}
    for source in after.sources:
        old = earlier.get(source.source)
        drafted = source.num_draft_tokens - (old.num_draft_tokens if old else 0)
        accepted = source.num_accepted_draft_tokens - (old.num_accepted_draft_tokens if old else 0)
        if drafted:
            by_source[source.source] = (drafted, accepted)
    return SpeculationDelta(
        num_draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
        num_accepted_draft_tokens=after.num_accepted_draft_tokens - before.num_accepted_draft_tokens,
        num_verify_steps=after.num_verify_steps - before.num_verify_steps,
        num_plain_decode_steps=after.num_plain_decode_steps - before.num_plain_decode_steps, by_source=by_source)


def _read_steps_by_k(metrics_url: str) -> dict[int, int] | None:
    """The scheduler's steps by chosen k, which only the Prometheus page carries; None when it cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(metrics_url, timeout=SERVER_INFO_TIMEOUT_S) as response:
            text = response.read().decode()
    except OSError:
        return None
    steps: dict[int, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name == STEPS_BY_K_METRIC:
            for sample in family.samples:
                if sample.name == f"{STEPS_BY_K_METRIC}_total":
                    steps[int(sample.labels["k"])] = int(sample.value)
    return steps


def _steps_delta(before: dict[int, int] | None, after: dict[int, int] | None) -> dict[int, int] | None:
    if before is None or after is None:
        return None
    delta = {k: count - before.get(k, 0) for k, count in after.items()}
    return {k: count for k, count in sorted(delta.items()) if count}


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


async def _run_cell(stack: _Served, prompt_set: PromptSet, concurrency: int, output_len: int,
                    requests_per_cell: int | None, round_index: int) -> CellResult:
    num_requests = requests_in_cell(concurrency, len(prompt_set.prompts), requests_per_cell)
    requests = [prompt_set.request(i % len(prompt_set.prompts), output_len) for i in range(num_requests)]
    before = (await stack.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=SERVER_INFO_TIMEOUT_S)).speculation
    steps_before = await asyncio.to_thread(_read_steps_by_k, stack.metrics_url)
    outputs, duration_s = await _send_all(stack.stub, requests, concurrency)
    after = (await stack.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=SERVER_INFO_TIMEOUT_S)).speculation
    steps_after = await asyncio.to_thread(_read_steps_by_k, stack.metrics_url)
    num_tokens = sum(len(o) for o in outputs)
    result = CellResult(
        config=stack.label, workload=prompt_set.name, concurrency=concurrency, round=round_index,
        num_requests=num_requests, num_output_tokens=num_tokens, duration_s=duration_s,
        tokens_per_s=num_tokens / duration_s, speculation=_speculation_delta(before, after),
        steps_by_k=_steps_delta(steps_before, steps_after), outputs=outputs)
    print(f"  {stack.label:>20} {prompt_set.name:>8} c={concurrency:<3}: {result.tokens_per_s:7.1f} tok/s "
          f"({num_requests} requests, {duration_s:5.1f} s), acceptance {result.speculation.acceptance_rate:.2f}",
          file=sys.stderr, flush=True)
    return result


async def _run_round(served: Sequence[tuple[str, str, str]], prompt_sets: Sequence[PromptSet],
                     concurrencies: Sequence[int], output_len: int, requests_per_cell: int | None,
                     round_index: int) -> tuple[list[CellResult], list[pb.ServerInfoResponse]]:
    """Every cell of one round, each run on every stack in turn ((label, gRPC address, metrics URL) per stack), the
    order of the stacks rotated from cell to cell and round to round, so that a cell's ratios compare runs seconds
    apart and no configuration always runs first."""
    channels = [grpc.aio.insecure_channel(address) for _, address, _ in served]
    try:
        stacks = [_Served(label, pb_grpc.SpecServeStub(channel), metrics_url)
                  for (label, _, metrics_url), channel in zip(served, channels)]
        for stack in stacks:
            await _generate(stack.stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                                                           params=pb.SamplingParams(max_tokens=8, ignore_eos=True)))
        results = []
        turn = round_index
        for prompt_set in prompt_sets:
            for stack in stacks:
                await _warm_up(stack, prompt_set)
            for concurrency in concurrencies:
                for offset in range(len(stacks)):
                    stack = stacks[(turn + offset) % len(stacks)]
                    results.append(await _run_cell(stack, prompt_set, concurrency, output_len, requests_per_cell,
                                                   round_index))
                turn += 1
        infos = [await stack.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=SERVER_INFO_TIMEOUT_S)
                 for stack in stacks]
        return results, infos
    finally:
        for channel in channels:
            await channel.close()


def _labels(configs: Sequence[str]) -> list[str]:
    """Each configuration's name in the tables, numbered where it is given more than once (e.g. 'none' twice, to
    measure the noise of a ratio)."""
    return [config if configs.count(config) == 1 else f"{config} #{configs[:i + 1].count(config)}"
            for i, config in enumerate(configs)]


def _baselines(results: Sequence[CellResult]) -> dict[tuple[str, int, int], CellResult]:
    """The first configuration's result for each (workload, concurrency, round)."""
    return {(r.workload, r.concurrency, r.round): r for r in results if r.config == results[0].config}


def first_differences(result: CellResult, baselines: dict[tuple[str, int, int], CellResult]) -> list[tuple[int, int]]:
    """(request index, first differing position) against the first configuration's outputs in the same cell, first round.

    A shorter output that agrees as far as it goes differs at its end (a grammar completed earlier).
    """
    reference = baselines[(result.workload, result.concurrency, 0)].outputs
    found = []
    for index, (ours, theirs) in enumerate(zip(result.outputs, reference)):
        if ours != theirs:
            found.append((index, next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                                      min(len(ours), len(theirs)))))
    return found


def _format_k(steps_by_k: dict[int, int] | None) -> str:
    if not steps_by_k:
        return "-"
    total = sum(steps_by_k.values())
    return " ".join(f"{k}:{100 * count / total:.0f}%" for k, count in sorted(steps_by_k.items()))


def _format_acceptance(rounds: Sequence[CellResult]) -> str:
    drafted = sum(r.speculation.num_draft_tokens for r in rounds)
    accepted = sum(r.speculation.num_accepted_draft_tokens for r in rounds)
    verify_steps = sum(r.speculation.num_verify_steps for r in rounds)
    steps = verify_steps + sum(r.speculation.num_plain_decode_steps for r in rounds)
    if not drafted:
        return "-"
    return f"{accepted / drafted:.2f} ({100 * verify_steps / steps:.0f}%)"


def format_tables(results: Sequence[CellResult]) -> str:
    """Rows: workload x concurrency. Per configuration: tok/s in the last round, the median of the rounds' ratios to the
    first configuration (with their range), acceptance over all rounds, and the most outputs that differed in a round;
    then the share of target steps by the k chosen in the last round (a step may choose k and find no draft)."""
    baselines = _baselines(results)
    first = results[0].config
    configs = list(dict.fromkeys(r.config for r in results))
    by_cell: dict[tuple[str, str, int], list[CellResult]] = {}
    for r in results:
        by_cell.setdefault((r.config, r.workload, r.concurrency), []).append(r)
    cells = list(dict.fromkeys((r.workload, r.concurrency) for r in results))
    header = ["workload", "c", f"{first} tok/s", f"{first} acceptance", f"{first} differing"]
    for config in configs[1:]:
        header += [f"{config} tok/s", f"{config} vs {first}", f"{config} acceptance", f"{config} differing"]
    lines = ["| " + " | ".join(header) + " |", "| --- | ---: |" + " ---: |" * (len(header) - 2)]
    for workload, concurrency in cells:
        row = [workload, str(concurrency)]
        for config in configs:
            rounds = by_cell[(config, workload, concurrency)]
            last = rounds[-1]
            differing = max(len(first_differences(r, baselines)) for r in rounds)
            row.append(f"{last.tokens_per_s:.1f}")
            if config != first:
                ratios = [r.tokens_per_s / baselines[(workload, concurrency, r.round)].tokens_per_s for r in rounds]
                spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
                row.append(f"{statistics.median(ratios):.2f}x{spread}")
            row += [_format_acceptance(rounds), f"{differing}/{last.num_requests}"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "acceptance: accepted / drafted tokens over all rounds (in brackets: the share of sequence steps that "
              "carried a draft); differing: outputs not token-identical to the first configuration's in the same cell, "
              "in the round with the most"]
    if len(configs) < 2 or all(r.steps_by_k is None for r in results):
        return "\n".join(lines)
    lines += ["", "Target steps by the k chosen (0: decoded plainly), last round:", "",
              "| workload | c | " + " | ".join(configs[1:]) + " |", "| --- | ---: |" + " --- |" * (len(configs) - 1)]
    for workload, concurrency in cells:
        lines.append(f"| {workload} | {concurrency} | " + " | ".join(
            _format_k(by_cell[(config, workload, concurrency)][-1].steps_by_k) for config in configs[1:]) + " |")
    return "\n".join(lines)


def load_prompt_sets(workloads: Sequence[str]) -> list[PromptSet]:
    """Every prompt as one user message through the model's chat template, as bench/spec_bench.py sends them."""
    from modeling.model_store import default_model_dir
    from modeling.tokenizer import ChatMessage, Tokenizer

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


def _batch_invariant(info: pb.ServerInfoResponse) -> bool | None:
    """Whether the target's steps are batch invariant (else greedy outputs may differ from plain decoding's at near-ties)."""
    target = next((p for p in info.processes if p.role == "target"), None)
    return target.batch_invariant if target is not None and target.HasField("batch_invariant") else None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", default=None,
                        help="`specserve up` speculation options for one stack, the first the baseline, e.g. 'none' or "
                             "'ngram --num-speculative-tokens 6' (repeatable; default: none, ngram, default)")
    parser.add_argument("--workload", action="append", choices=ALL_WORKLOADS, default=None,
                        help="workloads to run (repeatable; default: all)")
    parser.add_argument("--concurrency", action="append", type=int, default=None,
                        help=f"clients sending at once (repeatable; default: {', '.join(map(str, DEFAULT_CONCURRENCIES))})")
    parser.add_argument("--output-len", type=int, default=64, help="completion tokens per request at most")
    parser.add_argument("--requests-per-cell", type=int, default=None,
                        help="requests per cell, at least one per client (default: every prompt equally often, at "
                             "least twice the concurrency)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times the configurations take turns; each ratio is the median of the rounds' ratios")
    parser.add_argument("--extra-up-args", default="",
                        help="more `specserve up` flags for every stack, as one string, e.g. '--dtype bfloat16' or "
                             "'--speculation-policy fixed'")
    parser.add_argument("--json-out", type=Path, default=None, help="write every round's results here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rounds < 1 or args.output_len < 1:
        raise SystemExit("spec_matrix: --rounds and --output-len must be at least 1")
    concurrencies = args.concurrency or list(DEFAULT_CONCURRENCIES)
    if min(concurrencies) < 1 or (args.requests_per_cell is not None and args.requests_per_cell < 1):
        raise SystemExit("spec_matrix: --concurrency and --requests-per-cell must be at least 1")
    configs = args.config or list(DEFAULT_CONFIGS)
    extra = shlex.split(args.extra_up_args)
    if "--kv-cache-memory" not in extra:  # each stack's own, not a quarter of what the stacks before it left
        extra += ["--kv-cache-memory", str(KV_CACHE_GIB)]
    prompt_sets = load_prompt_sets(args.workload or ALL_WORKLOADS)
    results: list[CellResult] = []
    stacks: list[dict[str, Any]] = []
    started = time.perf_counter()
    labels = _labels(configs)
    for round_index in range(args.rounds):
        try:
            with ExitStack() as running_stacks:
                served = []
                for label, config in zip(labels, configs):
                    draft, *rest = shlex.split(config)
                    grpc_port, http_port = free_ports(2)
                    flags = ["--host", "127.0.0.1", "--port", str(grpc_port), "--http-port", str(http_port), *extra,
                             "--draft", draft, *rest]
                    print(f"round {round_index + 1}/{args.rounds}, starting: specserve up {shlex.join(flags)}",
                          file=sys.stderr, flush=True)
                    stack = running_stacks.enter_context(running_up(flags))
                    served.append((label, stack, f"http://127.0.0.1:{http_port}/metrics"))
                cells, infos = asyncio.run(_run_round(
                    [(label, stack.address, metrics_url) for label, stack, metrics_url in served],
                    prompt_sets, concurrencies, args.output_len, args.requests_per_cell, round_index))
        except StackError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        results += cells
        stacks += [{"config": label, "round": round_index, "ready_line": stack.ready_line, "dtype": stack.dtype,
                    "device": stack.device, "batch_invariant": _batch_invariant(info), "policy": info.speculation.policy}
                   for (label, stack, _), info in zip(served, infos)]
    machine = describe_machine(stacks[0]["dtype"], stacks[0]["device"])
    print(f"command: {shlex.join(sys.argv)}")
    print(f"machine: {json.dumps(machine)}")
    print(f"target batch invariant: {sorted({str(s['batch_invariant']) for s in stacks})}; "
          f"{args.rounds} round(s) in {time.perf_counter() - started:.0f} s\n")
    print(format_tables(results))
    if args.json_out is not None:
        baselines = _baselines(results)
        report = {"command": shlex.join(sys.argv), "machine": machine, "stacks": stacks,
                  "results": [asdict(r) | {"outputs": None, "first_differences": first_differences(r, baselines)}
                              for r in results]}
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
