"""Throughput of this checkout against an earlier revision, in one sitting:
`bench.grpc_bench --start` in each, interleaved.

The machine is shared and noisy, so only ratios measured side by side mean anything:
for each round, each draft and each revision in turn, the revision's own grpc_bench
starts its own stack (`specserve up`), runs every concurrency and stops it. The other
revision is checked out into a temporary git worktree (its kernels built there first);
the table gives each revision's median over rounds and the ratio of this checkout to it.

    python -m bench.compare_revisions --before 312e871 --draft none default --concurrency 1 16 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worktree(revision: str, parent: Path) -> Path:
    folder = parent / f"rev-{revision}"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(folder), revision], check=True, capture_output=True
    )
    return folder


def bench_once(checkout: Path, draft: str, args: argparse.Namespace, out: Path) -> dict[int, float]:
    """Output tok/s by concurrency, from `checkout`'s own grpc_bench on a stack of its own."""
    command = [
        sys.executable,
        "-m",
        "bench.grpc_bench",
        "--start",
        "--draft",
        draft,
        "--json-out",
        str(out),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--concurrency",
        *map(str, args.concurrency),
    ]
    if args.dtype:
        command += ["--dtype", args.dtype]
    print(f"[{checkout.name}] {' '.join(command[1:])}", file=sys.stderr, flush=True)
    # The checkout first on the path: `specserve up` is the venv's script, whose imports would find the installed
    # (editable) project otherwise.
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    subprocess.run(command, cwd=checkout, env=env, check=True, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    return {run["concurrency"]: run["output_tokens_per_s"] for run in report["runs"]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.compare_revisions",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--before", required=True, help="the git revision to compare with (a commit, tag or branch)")
    parser.add_argument(
        "--draft", nargs="+", default=["none", "default"], help="each run's --draft (default: none default)"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: what `specserve up` picks")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (medians are reported)")
    parser.add_argument("--json-out", type=Path, help="also write every round's figures here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="specserve-compare-") as temp:
        before = worktree(args.before, Path(temp))
        try:
            subprocess.run(
                [sys.executable, "-m", "modeling.kernels.native"], cwd=before, check=True, capture_output=True
            )
            checkouts = {"before": before, "after": REPO}
            figures: dict[tuple[str, str, int], list[float]] = defaultdict(list)
            for round_index in range(args.rounds):
                for draft in args.draft:
                    order = ("before", "after") if round_index % 2 == 0 else ("after", "before")
                    for name in order:
                        measured = bench_once(checkouts[name], draft, args, Path(temp) / f"{name}.json")
                        for concurrency, tok_s in measured.items():
                            figures[name, draft, concurrency].append(tok_s)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(before)], capture_output=True)

    print(f"output tok/s, medians of {args.rounds} interleaved rounds; before = {args.before}, after = this checkout")
    print("| draft | concurrency | before | after | after / before |")
    print("| --- | --- | --- | --- | --- |")
    for draft in args.draft:
        for concurrency in args.concurrency:
            old = statistics.median(figures["before", draft, concurrency])
            new = statistics.median(figures["after", draft, concurrency])
            print(f"| {draft} | {concurrency} | {old:.1f} | {new:.1f} | {new / old:.2f} |")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({f"{n}/{d}/{c}": v for (n, d, c), v in figures.items()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
