"""The speculation benchmark's arithmetic: speed-ups are ratios within a round, outputs compare with the first run."""

from __future__ import annotations

from bench.spec_bench import WorkloadResult, find_divergences, format_table
from bench.spec_matrix import _labels


def _result(config: str, round_index: int, tokens_per_s: float, outputs: list[list[int]]) -> WorkloadResult:
    return WorkloadResult(
        config=config,
        workload="chat",
        round=round_index,
        num_requests=len(outputs),
        num_output_tokens=sum(len(o) for o in outputs),
        duration_s=1.0,
        tokens_per_s=tokens_per_s,
        num_draft_tokens=10,
        num_accepted_draft_tokens=4,
        num_verify_steps=2,
        acceptance_rate=0.4,
        mean_accepted_length=2.0,
        outputs=outputs,
    )


def test_each_speed_up_is_the_median_of_ratios_taken_within_a_round() -> None:
    # The plain speed drops from 100 to 60 between rounds; a ratio across rounds would say 1.5 / 0.9.
    results = [
        _result("none", 0, 100.0, [[1, 2]]),
        _result("ngram", 0, 120.0, [[1, 2]]),
        _result("none", 1, 60.0, [[1, 2]]),
        _result("ngram", 1, 90.0, [[1, 2]]),
        _result("none", 2, 80.0, [[1, 2]]),
        _result("ngram", 2, 104.0, [[1, 2]]),
    ]
    table = format_table(results)
    ngram_row = next(line for line in table.splitlines() if line.startswith("| ngram "))
    assert "120.0, 90.0, 104.0" in ngram_row
    assert "1.30x (1.20-1.50)" in ngram_row  # ratios 1.2, 1.5, 1.3: median 1.3
    assert ngram_row.endswith("| 1/1 |")


def test_an_output_that_changes_in_a_later_round_is_a_divergence() -> None:
    results = [
        _result("none", 0, 100.0, [[1, 2, 3]]),
        _result("ngram", 0, 150.0, [[1, 2, 3]]),
        _result("none", 1, 100.0, [[1, 2, 3]]),
        _result("ngram", 1, 150.0, [[1, 2, 4]]),
    ]
    [(diverged, prompt_index, position)] = find_divergences(results)
    assert (diverged.config, diverged.round, prompt_index, position) == ("ngram", 1, 0, 2)
    assert format_table(results).splitlines()[-1].endswith("| 0/1 |")


def test_a_configuration_given_twice_is_told_apart_in_the_matrix() -> None:
    """`--config none --config none` measures the noise of a ratio: each gets its own column."""
    assert _labels(["none", "ngram", "none"]) == ["none #1", "ngram", "none #2"]
    assert _labels(["none", "default"]) == ["none", "default"]
