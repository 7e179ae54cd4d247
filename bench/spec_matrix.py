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
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.grpc_bench import DEFAULT_CONCURRENCIES
from bench.local_stack import running_up
from bench.machine_info import describe_machine
from bench.matrix_cells import ALL_WORKLOADS, CellResult, load_prompt_sets, run_round
from bench.matrix_tables import baseline_results, first_differences, format_tables
from proto import specserve_pb2 as pb
from specserve.local_stack import StackError
from specserve.stack import free_ports

DEFAULT_CONFIGS = ("none", "ngram", "default")

KV_CACHE_GIB = 2  # per stack unless --extra-up-args says: ample for 64 clients, and the same for every configuration


def _labels(configs: Sequence[str]) -> list[str]:
    """Each configuration's name in the tables, numbered where it is given more than once (e.g. 'none' twice, to
    measure the noise of a ratio)."""
    return [
        config if configs.count(config) == 1 else f"{config} #{configs[: i + 1].count(config)}"
        for i, config in enumerate(configs)
    ]


def _batch_invariant(info: pb.ServerInfoResponse) -> bool | None:
    """Whether the target's steps are batch invariant
    (else greedy outputs may differ from plain decoding's at near-ties)."""
    target = next((p for p in info.processes if p.role == "target"), None)
    return target.batch_invariant if target is not None and target.HasField("batch_invariant") else None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config",
        action="append",
        default=None,
        help="`specserve up` speculation options for one stack, the first the baseline, e.g. 'none' or "
        "'ngram --num-speculative-tokens 6' (repeatable; default: none, ngram, default)",
    )
    parser.add_argument(
        "--workload",
        action="append",
        choices=ALL_WORKLOADS,
        default=None,
        help="workloads to run (repeatable; default: all)",
    )
    parser.add_argument(
        "--concurrency",
        action="append",
        type=int,
        default=None,
        help=f"clients sending at once (repeatable; default: {', '.join(map(str, DEFAULT_CONCURRENCIES))})",
    )
    parser.add_argument("--output-len", type=int, default=64, help="completion tokens per request at most")
    parser.add_argument(
        "--requests-per-cell",
        type=int,
        default=None,
        help="requests per cell, at least one per client (default: every prompt equally often, at "
        "least twice the concurrency)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="times the configurations take turns; each ratio is the median of the rounds' ratios",
    )
    parser.add_argument(
        "--extra-up-args",
        default="",
        help="more `specserve up` flags for every stack, as one string, e.g. '--dtype bfloat16' or "
        "'--speculation-policy fixed'",
    )
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
                    flags = [
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(grpc_port),
                        "--http-port",
                        str(http_port),
                        *extra,
                        "--draft",
                        draft,
                        *rest,
                    ]
                    print(
                        f"round {round_index + 1}/{args.rounds}, starting: specserve up {shlex.join(flags)}",
                        file=sys.stderr,
                        flush=True,
                    )
                    stack = running_stacks.enter_context(running_up(flags))
                    served.append((label, stack, f"http://127.0.0.1:{http_port}/metrics"))
                cells, infos = asyncio.run(
                    run_round(
                        [(label, stack.address, metrics_url) for label, stack, metrics_url in served],
                        prompt_sets,
                        concurrencies,
                        args.output_len,
                        args.requests_per_cell,
                        round_index,
                    )
                )
        except StackError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        results += cells
        stacks += [
            {
                "config": label,
                "round": round_index,
                "ready_line": stack.ready_line,
                "dtype": stack.dtype,
                "device": stack.device,
                "batch_invariant": _batch_invariant(info),
                "policy": info.speculation.policy,
            }
            for (label, stack, _), info in zip(served, infos)
        ]
    machine = describe_machine(stacks[0]["dtype"], stacks[0]["device"])
    print(f"command: {shlex.join(sys.argv)}")
    print(f"machine: {json.dumps(machine)}")
    print(
        f"target batch invariant: {sorted({str(s['batch_invariant']) for s in stacks})}; "
        f"{args.rounds} round(s) in {time.perf_counter() - started:.0f} s\n"
    )
    print(format_tables(results))
    if args.json_out is not None:
        baselines = baseline_results(results)
        report = {
            "command": shlex.join(sys.argv),
            "machine": machine,
            "stacks": stacks,
            "results": [
                asdict(r) | {"outputs": None, "first_differences": first_differences(r, baselines)} for r in results
            ],
        }
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
