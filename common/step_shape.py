"""A step's shape as its cost model reads it (scheduler/speculation/cost.py); workers time warm-up steps in it too."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Where the cost of a decode row may change its slope: up to the first knot rows share the weights' reading (nearly free
# where a step is bound by memory), beyond it they fill the kernels' tiles, beyond the second they are plain compute.
ROW_KNOTS = (8, 32)


def row_terms(rows: int) -> tuple[float, float, float]:
    """`rows` split at the knots: (the first 8, the next 24, the rest)."""
    low, high = ROW_KNOTS
    return float(min(rows, low)), float(min(max(rows - low, 0), high - low)), float(max(rows - high, 0))


@dataclass(frozen=True)
class StepShape:
    """What a step computes, in the model's terms."""

    decode_rows: int  # rows of decoding sequences: their last token plus their draft tokens
    prefill_tokens: int  # prompt (or recomputed) tokens of sequences that are not decoding
    attended: int  # the positions all its rows attend to, summed over rows
    # Of the decode rows, those of sequences under a grammar: each takes a token mask besides its logits.
    constrained_rows: int = 0

    def terms(self) -> tuple[float, ...]:
        """(1, the decode rows split at ROW_KNOTS, constrained rows, prefill tokens,
        thousands of attended positions)."""
        return (
            1.0,
            *row_terms(self.decode_rows),
            float(self.constrained_rows),
            float(self.prefill_tokens),
            self.attended / 1000.0,
        )


def step_shape(seqs: Sequence[tuple[int, int, int, bool]]) -> StepShape:
    """The shape of a step from each sequence's (tokens it computes, draft tokens it verifies, positions computed
    before the step, whether a grammar constrains it)."""
    decode_rows = prefill = attended = constrained = 0
    for num_tokens, num_draft, computed_before, under_grammar in seqs:
        rows = num_tokens + num_draft
        if num_tokens == 1:
            decode_rows += rows
        else:
            prefill += num_tokens
            decode_rows += num_draft
        if under_grammar:
            constrained += rows if num_tokens == 1 else num_draft + 1
        # Row i attends to the positions before it and itself: computed_before + i + 1.
        attended += rows * computed_before + rows * (rows + 1) // 2
    return StepShape(decode_rows, prefill, attended, constrained)
