"""What a step costs on one target worker, learned from the steps it ran: the price side of the speculation decision.

A step's time is modelled as a fixed part plus a part per row it decodes or verifies (a
sequence's last token and each of its draft tokens), a part per prompt token it computes
(prefill rows come in chunks, which the kernels run more cheaply per row), and a part per
thousand positions its rows attend to (attention grows with each row's context):

    t = c0 + c_row * decode_rows + c_prefill * prefill_tokens + c_ctx * attended / 1000

The coefficients are fitted to every `StepResult.duration_ms` by least squares with
exponential forgetting (each step weighs FORGET times what the one after it does), so the
model follows a machine whose speed changes (a neighbour, another format, a warm cache),
and a little ridge (relative to each term's own weight) keeps it solvable where the steps
seen cannot tell two terms apart; a term no step had stays 0.
Kernels make this curve differ by machine and format: it is learned where it runs, never
written down.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FORGET = 0.98  # the weight of a step, relative to the next one's: about the last 50 steps count
RIDGE = 1e-4  # pulls the coefficients toward zero where the steps seen say little about them
MIN_STEPS = 8  # steps seen before the model predicts anything
_NUM_TERMS = 4


@dataclass(frozen=True)
class StepShape:
    """What a step computes, in the model's terms."""

    decode_rows: int  # rows of decoding sequences: their last token plus their draft tokens
    prefill_tokens: int  # prompt (or recomputed) tokens of sequences that are not decoding
    attended: int  # the positions all its rows attend to, summed over rows

    def terms(self) -> tuple[float, ...]:
        return 1.0, float(self.decode_rows), float(self.prefill_tokens), self.attended / 1000.0


def step_shape(seqs: Sequence[tuple[int, int, int]]) -> StepShape:
    """The shape of a step from each sequence's (tokens it computes, draft tokens it verifies, positions computed
    before the step)."""
    decode_rows = prefill = attended = 0
    for num_tokens, num_draft, computed_before in seqs:
        rows = num_tokens + num_draft
        if num_tokens == 1:
            decode_rows += rows
        else:
            prefill += num_tokens
            decode_rows += num_draft
        # Row i attends to the positions before it and itself: computed_before + i + 1.
        attended += rows * computed_before + rows * (rows + 1) // 2
    return StepShape(decode_rows, prefill, attended)


class StepCostModel:
    """A worker's fitted step time; `observe` each finished step, `predict_ms` a planned one."""

    def __init__(self) -> None:
        self._gram = [[0.0] * _NUM_TERMS for _ in range(_NUM_TERMS)]  # sum of w x x^T
        self._moment = [0.0] * _NUM_TERMS  # sum of w x y
        self._coefficients: list[float] | None = None  # solved lazily; None: to be solved again
        self.num_steps = 0
        self.last_predicted_ms: float | None = None  # what the model said of the last step before it was observed
        self.last_measured_ms: float | None = None
        self.abs_error_ms = 0.0  # a moving average of |predicted - measured|, over the steps it predicted

    def observe(self, shape: StepShape, duration_ms: float) -> None:
        if not duration_ms >= 0.0:  # NaN or negative: a clock that cannot be believed
            return
        predicted = self.predict_ms(shape)
        if predicted is not None:
            self.abs_error_ms = FORGET * self.abs_error_ms + (1 - FORGET) * abs(predicted - duration_ms)
        self.last_predicted_ms, self.last_measured_ms = predicted, duration_ms
        x = shape.terms()
        for i in range(_NUM_TERMS):
            for j in range(_NUM_TERMS):
                self._gram[i][j] = FORGET * self._gram[i][j] + x[i] * x[j]
            self._moment[i] = FORGET * self._moment[i] + x[i] * duration_ms
        self._coefficients = None
        self.num_steps += 1

    def predict_ms(self, shape: StepShape) -> float | None:
        """The expected time of a step of this shape; None until MIN_STEPS steps were seen."""
        coefficients = self.coefficients()
        if coefficients is None:
            return None
        return max(0.0, sum(c * x for c, x in zip(coefficients, shape.terms())))

    def coefficients(self) -> list[float] | None:
        """(fixed ms, ms per decode row, ms per prefill token, ms per thousand attended positions), each at least 0;
        None before MIN_STEPS steps."""
        if self.num_steps < MIN_STEPS:
            return None
        if self._coefficients is None:
            self._coefficients = self._fit()
        return self._coefficients

    def _fit(self) -> list[float]:
        """Least squares with every coefficient at least 0: no part of a step makes it faster, and where two terms
        move together (rows and the positions they attend to) an unconstrained fit can trade one for a negative
        other. A term that comes out negative is left out and the rest fitted again."""
        terms = list(range(_NUM_TERMS))
        while True:
            # The ridge is relative to each term's own weight, so terms of different units are pulled alike.
            gram = [[self._gram[i][j] * (1 + RIDGE) if i == j else self._gram[i][j] for j in terms] for i in terms]
            solved = _solve(gram, [self._moment[i] for i in terms])
            negative = [term for term, value in zip(terms, solved) if value < 0.0]
            if not negative:
                coefficients = [0.0] * _NUM_TERMS
                for term, value in zip(terms, solved):
                    coefficients[term] = value
                return coefficients
            terms.remove(min(negative, key=lambda term: solved[terms.index(term)]))


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """x with matrix @ x = vector (Gaussian elimination with partial pivoting; the matrix is small and, with its
    ridge, positive definite)."""
    n = len(vector)
    rows = [list(row) + [value] for row, value in zip(matrix, vector)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        if rows[col][col] == 0.0:
            continue  # a term no step had: its coefficient stays 0
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            for c in range(col, n + 1):
                rows[r][c] -= factor * rows[col][c]
    solution = [0.0] * n
    for col in range(n - 1, -1, -1):
        if rows[col][col] != 0.0:
            solution[col] = (rows[col][n] - sum(rows[col][c] * solution[c] for c in range(col + 1, n))) / rows[col][col]
    return solution
