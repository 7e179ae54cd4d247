"""The matrix's tables: each cell's speed as a ratio to the first configuration's in the same round, its acceptance, the
outputs that differ from the first configuration's, and the share of target steps by the k chosen."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from bench.matrix_cells import CellResult


def baseline_results(results: Sequence[CellResult]) -> dict[tuple[str, int, int], CellResult]:
    """The first configuration's result for each (workload, concurrency, round)."""
    return {(r.workload, r.concurrency, r.round): r for r in results if r.config == results[0].config}


def first_differences(result: CellResult, baselines: dict[tuple[str, int, int], CellResult]) -> list[tuple[int, int]]:
    """(request index, first differing position) against the first configuration's outputs
    in the same cell, first round.

    A shorter output that agrees as far as it goes differs at its end (a grammar completed earlier).
    """
    reference = baselines[(result.workload, result.concurrency, 0)].outputs
    found = []
    for index, (ours, theirs) in enumerate(zip(result.outputs, reference)):
        if ours != theirs:
            found.append(
                (index, next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs))))
            )
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
    baselines = baseline_results(results)
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
    lines += [
        "",
        "acceptance: accepted / drafted tokens over all rounds (in brackets: the share of sequence steps that "
        "carried a draft); differing: outputs not token-identical to the first configuration's in the same cell, "
        "in the round with the most",
    ]
    if len(configs) < 2 or all(r.steps_by_k is None for r in results):
        return "\n".join(lines)
    lines += [
        "",
        "Target steps by the k chosen (0: decoded plainly), last round:",
        "",
        "| workload | c | " + " | ".join(configs[1:]) + " |",
        "| --- | ---: |" + " --- |" * (len(configs) - 1),
    ]
    for workload, concurrency in cells:
        lines.append(
            f"| {workload} | {concurrency} | "
            + " | ".join(_format_k(by_cell[(config, workload, concurrency)][-1].steps_by_k) for config in configs[1:])
            + " |"
        )
    return "\n".join(lines)
