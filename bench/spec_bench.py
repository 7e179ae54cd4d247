"""Speculative decoding benchmark: one request at a time, greedy (or sampled with `--temperature`, each prompt with
its own fixed seed), with and without the n-gram draft service.

For each stack configuration (`specserve up --draft none`, then `--draft ngram`, ...) it
sends every prompt of each workload (bench/spec_prompts.py) one after another, and
reports completion tokens per second, the acceptance rate and the mean accepted length
(from the server's counters), and whether the outputs are token-identical to the first
configuration's. Figures are ratios measured in one run on the same machine.

With `--rounds N` the configurations take turns N times (none, ngram, none, ngram, ...),
and each speed-up is the median of its rounds' ratios to the first configuration in the
same round: on a shared machine the plain speed drifts by 5-15% within minutes, which a
ratio taken across rounds would count as a gain or a loss.

    python bench/spec_bench.py --output-len 128 --config none --config ngram [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine_info import describe_machine
from bench.local_stack import running_up
from bench.spec_prompts import WORKLOADS
from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc
from specserve.stack import free_ports


@dataclass(frozen=True)
class WorkloadResult:
    config: str
    workload: str
    round: int
    num_requests: int
    num_output_tokens: int
    duration_s: float
    tokens_per_s: float
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    num_verify_steps: int
    acceptance_rate: float
    mean_accepted_length: float  # accepted draft tokens per verify step
    outputs: list[list[int]]


SEED = 1000  # prompt i of a workload is sampled with seed SEED + i


async def _one(
    stub: pb_grpc.SpecServeStub,
    prompt_ids: list[int],
    output_len: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[int]:
    params = pb.SamplingParams(max_tokens=output_len, temperature=temperature, top_p=top_p, seed=seed, ignore_eos=True)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids), params=params)
    tokens: list[int] = []
    async for chunk in stub.Generate(request, timeout=600):
        tokens.extend(chunk.token_ids)
    return tokens


async def _run_config(
    address: str,
    config: str,
    prompts_of: dict[str, list[list[int]]],
    output_len: int,
    repeats: int,
    round_index: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> list[WorkloadResult]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.SpecServeStub(channel)
        await _one(stub, [1, 2, 3], 8)  # warm-up
        results = []
        for workload, prompts in prompts_of.items():
            before = (await stub.GetServerInfo(pb.ServerInfoRequest(), timeout=10)).speculation
            outputs: list[list[int]] = []
            started = time.perf_counter()
            for _ in range(repeats):
                # Sampled: each prompt its own seed, the same in every configuration (the outputs are compared).
                outputs = [
                    await _one(stub, ids, output_len, temperature, top_p, SEED + index)
                    for index, ids in enumerate(prompts)
                ]
            duration_s = time.perf_counter() - started
            after = (await stub.GetServerInfo(pb.ServerInfoRequest(), timeout=10)).speculation
            proposed = after.num_draft_tokens - before.num_draft_tokens
            accepted = after.num_accepted_draft_tokens - before.num_accepted_draft_tokens
            verify_steps = after.num_verify_steps - before.num_verify_steps
            num_tokens = repeats * sum(len(o) for o in outputs)
            results.append(
                WorkloadResult(
                    config=config,
                    workload=workload,
                    round=round_index,
                    num_requests=repeats * len(prompts),
                    num_output_tokens=num_tokens,
                    duration_s=duration_s,
                    tokens_per_s=num_tokens / duration_s,
                    num_draft_tokens=proposed,
                    num_accepted_draft_tokens=accepted,
                    num_verify_steps=verify_steps,
                    acceptance_rate=accepted / proposed if proposed else 0.0,
                    mean_accepted_length=accepted / verify_steps if verify_steps else 0.0,
                    outputs=outputs,
                )
            )
            print(
                f"  {config:>28} {workload:>8}: {num_tokens / duration_s:6.1f} tok/s, "
                f"acceptance {results[-1].acceptance_rate:.2f}, accepted/verify {results[-1].mean_accepted_length:.2f}",
                file=sys.stderr,
                flush=True,
            )
        return results


@dataclass(frozen=True)
class Divergence:
    config: str
    workload: str
    prompt_index: int
    position: int  # first completion token that differs from the first configuration's output
    top2_margin: float  # the target's top-2 logit gap there, recomputed on the first configuration's prefix


def _baselines(results: Sequence[WorkloadResult]) -> dict[tuple[str, int], WorkloadResult]:
    """The first configuration's result for each (workload, round)."""
    return {(r.workload, r.round): r for r in results if r.config == results[0].config}


def _first_outputs(results: Sequence[WorkloadResult]) -> dict[str, list[list[int]]]:
    """What every output is compared with: the first configuration's, in the first round."""
    return {workload: r.outputs for (workload, round_index), r in _baselines(results).items() if round_index == 0}


def find_divergences(results: Sequence[WorkloadResult]) -> list[tuple[WorkloadResult, int, int]]:
    """(result, prompt index, first differing position) against the first configuration's outputs in its first round."""
    first = _first_outputs(results)
    found = []
    for r in results:
        for index, (ours, theirs) in enumerate(zip(r.outputs, first[r.workload])):
            position = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            if position is not None:
                found.append((r, index, position))
    return found


def explain_divergences(
    results: Sequence[WorkloadResult], prompts_of: dict[str, list[list[int]]], dtype: str, model: Path
) -> list[Divergence]:
    """The target's top-2 logit margin at each divergence: a near-tie means rounding, not a wrong token."""
    import torch

    from modeling.model.batch import SeqSpan
    from modeling.model.config import ModelConfig
    from modeling.model.engine import ModelEngine
    from modeling.model.kv_cache import pages_for_slots

    found = find_divergences(results)
    if not found:
        return []
    engine = ModelEngine(
        model,
        ModelConfig.from_folder(model),
        device="cpu",
        dtype=dtype,
        num_pages=pages_for_slots(1, 2048),
        max_len=2048,
    )
    engine.load()
    engine.allocate()
    first = _first_outputs(results)
    explained = []
    for r, index, position in found:
        prefix = prompts_of[r.workload][index] + first[r.workload][index][:position]
        logits = engine.forward([SeqSpan(engine.slot_pages(0), 0, prefix, 1)])[0].float()
        top2 = torch.topk(logits, 2).values
        explained.append(Divergence(r.config, r.workload, index, position, float(top2[0] - top2[1])))
    return explained


def format_table(results: Sequence[WorkloadResult]) -> str:
    """One row per configuration and workload: tok/s of each round, the median of the rounds' ratios to the first."""
    baselines = _baselines(results)
    first_outputs = _first_outputs(results)
    rows: dict[tuple[str, str], list[WorkloadResult]] = {}
    for r in results:
        rows.setdefault((r.config, r.workload), []).append(r)
    lines = [
        "| config | workload | tok/s (each round) | vs first (median) | acceptance | accepted per verify "
        "| identical to first |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for (config, workload), rounds in rows.items():
        ratios = [r.tokens_per_s / baselines[(workload, r.round)].tokens_per_s for r in rounds]
        last = rounds[-1]
        same = min(sum(1 for a, b in zip(r.outputs, first_outputs[workload]) if a == b) for r in rounds)
        speeds = ", ".join(f"{r.tokens_per_s:.1f}" for r in rounds)
        spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
        lines.append(
            f"| {config} | {workload} | {speeds} | {statistics.median(ratios):.2f}x{spread} | "
            f"{last.acceptance_rate:.2f} | {last.mean_accepted_length:.2f} | {same}/{len(last.outputs)} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config",
        action="append",
        default=None,
        help="`specserve up` speculation options for one stack, e.g. 'none' or 'ngram' or "
        "'ngram --num-speculative-tokens 6' or 'default' (prompt lookup, then the shipped phrases) or "
        "'eagle:drafts/SmolLM2-135M-Instruct' (the head alone) (repeatable; default: none, ngram)",
    )
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="passes over each workload's prompts")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="times the configurations take turns; each speed-up is the median of the rounds' ratios",
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    parser.add_argument(
        "--workload",
        action="append",
        choices=sorted(WORKLOADS),
        default=None,
        help="workloads to run (repeatable; default: all)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample at this temperature (0: greedy), each prompt with its own fixed seed",
    )
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--json-out", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        raise SystemExit("spec_bench: --rounds and --repeats must be at least 1")
    configs = args.config or ["none", "ngram"]
    from common.text.tokenizer import ChatMessage, Tokenizer
    from modeling.model.store import default_model_dir

    model = default_model_dir()
    tokenizer = Tokenizer.load(model)
    prompts_of = {
        name: [tokenizer.encode_chat([ChatMessage("user", text)]) for text in texts]
        for name, texts in WORKLOADS.items()
        if args.workload is None or name in args.workload
    }
    results: list[WorkloadResult] = []
    for round_index in range(args.rounds):
        for config in configs:
            draft, *rest = shlex.split(config)
            grpc_port, http_port = free_ports(2)
            flags = [
                "--host",
                "127.0.0.1",
                "--port",
                str(grpc_port),
                "--http-port",
                str(http_port),
                *(["--dtype", args.dtype] if args.dtype else []),
                "--draft",
                draft,
                *rest,
            ]
            print(
                f"round {round_index + 1}/{args.rounds}, starting: specserve up {shlex.join(flags)}",
                file=sys.stderr,
                flush=True,
            )
            with running_up(flags) as stack:
                dtype = stack.dtype
                results += asyncio.run(
                    _run_config(
                        stack.address,
                        config,
                        prompts_of,
                        args.output_len,
                        args.repeats,
                        round_index,
                        args.temperature,
                        args.top_p,
                    )
                )
    print(format_table(results))
    divergences = explain_divergences(results, prompts_of, dtype, model) if args.temperature == 0 else []
    for d in divergences:
        print(
            f"{d.config} / {d.workload} prompt {d.prompt_index}: first different token at {d.position}, "
            f"where the target's top-2 logit margin is {d.top2_margin:.4f}"
        )
    if args.json_out is not None:
        report: dict[str, Any] = {
            "command": shlex.join(sys.argv),
            "machine": describe_machine(args.dtype, None),
            "results": [asdict(r) | {"outputs": None} for r in results],
            "divergences": [asdict(d) for d in divergences],
        }
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
