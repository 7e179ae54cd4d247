"""What a step costs on one target worker, learned from the steps it ran: the price side of the speculation decision.

A step's time is modelled as a fixed part plus a part per row it decodes or verifies (a
sequence's last token and each of its draft tokens), a part per prompt token it computes
(prefill rows come in chunks, which the kernels run more cheaply per row), and a part per
thousand positions its rows attend to (attention grows with each row's context):

    t = c0 + row_cost(decode_rows) + c_prefill * prefill_tokens + c_ctx * attended / 1000

where row_cost is piecewise linear, its slope free to change at 8 and 32 rows
(common/step_shape.py ROW_KNOTS): a step bound by reading the weights takes its first few
rows almost for free, and one line through every row count would price a verify step's
few extra rows at what rows cost in a step of 64.

The coefficients are fitted to every `StepResult.duration_ms` by least squares with
exponential forgetting, so the model follows a machine whose speed changes (a neighbour,
another format, a warm cache). Steps fall in regions (`region_of`: up to 8 decode rows, up
to 32, more, and steps with prompt tokens), and a step is priced by its region's own fit:
that region's steps, the others' at ELSEWHERE_WEIGHT. A step makes the steps of its own
region count FORGET times less, the others only FORGET_ELSEWHERE times less. One line
through every shape cannot follow 64-row steps (slower than the terms add up to, with a
busy client on the same cores) and one-row steps alike, and fitted to both it priced a
one-row step at 12-30 ms after a few seconds at 64 sequences, where it took 4.5.

What the steps served cannot tell apart, the worker's warm-up says. A server at one
sequence runs nothing but one-row steps, which fix the fixed part plus one row and say
nothing of what a second row adds; fitted to them alone, that split drifts wherever the
ridge puts it (the price of a draft row rose from 0.6 to 1.5 ms in a few hundred steps, so
whether a request speculated depended on how long the server had run). So the shapes the
worker timed at warm-up (one row and a verify step's rows, at short and long context:
`StepTiming`) stay in every region's fit for good, each worth one step, their times scaled
by how the steps served compare with the warm-up's own fit (on a machine twice as slow as
at start-up, the warm-up reads twice as slow). Served steps outweigh them wherever they
say something; a little ridge (relative to each term's own weight) keeps the rest
solvable, and a term nothing had stays 0.
Kernels make this curve differ by machine and format: it is learned where it runs, never
written down.
"""

from __future__ import annotations

from common.step_shape import ROW_KNOTS, StepShape, row_terms

FORGET = 0.98  # the weight of a step, relative to the next one's in its region: about the last 50 steps count
FORGET_ELSEWHERE = 0.998  # the same, relative to a step in another region (region_of): about the last 500
ELSEWHERE_WEIGHT = 0.05  # what a step weighs in the fit of another region than its own
RIDGE = 1e-4  # pulls the coefficients toward zero where the steps seen say little about them
MIN_STEPS = 4  # steps seen (a worker's warm-up timings among them) before the model predicts anything
_NUM_REGIONS = 4  # region_of's
_NUM_TERMS = 7  # fixed, three row slopes, per constrained row, per prefill token, per thousand attended positions


def region_of(shape: StepShape) -> int:
    """Which steps a step's forgetting is kept among (`OnlineFit`): those that compute prompt tokens (3), else by decode
    rows, at ROW_KNOTS (0: up to the first knot, 1: up to the second, 2: beyond)."""
    if shape.prefill_tokens:
        return 3
    return sum(shape.decode_rows > knot for knot in ROW_KNOTS)


class OnlineFit:
    """y as a linear function of a few terms, each coefficient at least 0, fitted by least squares with forgetting, and
    lasting samples (`observe_lasting`) that never fade, their y scaled to the speed the others show.

    Samples fall in regions (the caller's, `region_of` for steps), and each region has a fit of its own: its samples,
    the other regions' at ELSEWHERE_WEIGHT, and the lasting samples. A sample makes its own region forget at FORGET,
    the others at FORGET_ELSEWHERE."""

    def __init__(self, num_terms: int, min_samples: int, num_regions: int = 1) -> None:
        self._num_terms, self._min_samples = num_terms, min_samples
        # Per region, the forgetting sums of w x x^T (flat, row by row) and of w x y, each kept divided by the region's
        # `_weight` (what forgetting has multiplied them by since): a sample changes one region's sums, not all.
        self._gram = [[0.0] * (num_terms * num_terms) for _ in range(num_regions)]
        self._moment = [[0.0] * num_terms for _ in range(num_regions)]
        self._weight = [1.0] * num_regions
        self._lasting_gram = [[0.0] * num_terms for _ in range(num_terms)]
        self._lasting_moment = [0.0] * num_terms
        self._lasting_alone: list[float] | None = None  # the lasting samples' own fit (what the scale compares with)
        self._measured = self._expected = 0.0  # forgetting sums of y and of the lasting fit's y, over the others
        self._coefficients: dict[int, list[float]] = {}  # per region, solved lazily (cleared by every sample)
        self.last_region = 0  # the latest sample's: the region `coefficients` reads unless told
        self.num_samples = 0

    def observe(self, x: tuple[float, ...], y: float, region: int = 0) -> None:
        n = self._num_terms
        weight = self._weight
        for other in range(len(weight)):
            weight[other] *= FORGET_ELSEWHERE
        weight[region] *= FORGET / FORGET_ELSEWHERE
        gram, moment = self._gram[region], self._moment[region]
        if weight[region] < 1e-100:  # fold the forgetting into the sums before 1 / weight grows too large
            gram[:] = [value * weight[region] for value in gram]
            moment[:] = [value * weight[region] for value in moment]
            weight[region] = 1.0
        inverse = 1.0 / weight[region]
        for i in range(n):
            if (scaled := x[i] * inverse) != 0.0:
                row = i * n
                for j in range(n):
                    gram[row + j] += scaled * x[j]
                moment[i] += scaled * y
        if self._lasting_alone is not None and (expected := _dot(self._lasting_alone, x)) > 0.0:
            self._measured = FORGET * self._measured + y
            self._expected = FORGET * self._expected + expected
        self._coefficients.clear()
        self.last_region = region
        self.num_samples += 1

    def observe_lasting(self, x: tuple[float, ...], y: float) -> None:
        """A sample that stays in every region's fit, worth one of the others, at the speed they show."""
        for i in range(self._num_terms):
            for j in range(self._num_terms):
                self._lasting_gram[i][j] += x[i] * x[j]
            self._lasting_moment[i] += x[i] * y
        self._lasting_alone = _fit_nonnegative(self._lasting_gram, self._lasting_moment)
        self._coefficients.clear()
        self.num_samples += 1

    @property
    def scale(self) -> float:
        """How much slower (> 1) or faster the samples that fade are than the lasting ones' fit says: 1 before any."""
        return self._measured / self._expected if self._expected > 0.0 else 1.0

    def predict(self, x: tuple[float, ...], region: int = 0) -> float | None:
        coefficients = self.coefficients(region)
        if coefficients is None:
            return None
        return max(0.0, _dot(coefficients, x))

    def coefficients(self, region: int | None = None) -> list[float] | None:
        """Region `region`'s (default: the latest sample's), each at least 0; None before min_samples samples."""
        if self.num_samples < self._min_samples:
            return None
        region = self.last_region if region is None else region
        if (known := self._coefficients.get(region)) is not None:
            return known
        n, scale = self._num_terms, self.scale
        gram = [value for row in self._lasting_gram for value in row]
        moment = [scale * value for value in self._lasting_moment]
        for other, weight in enumerate(self._weight):
            factor = weight * (1.0 if other == region else ELSEWHERE_WEIGHT)
            gram = [total + factor * value for total, value in zip(gram, self._gram[other])]
            moment = [total + factor * value for total, value in zip(moment, self._moment[other])]
        coefficients = _fit_nonnegative([gram[i * n : (i + 1) * n] for i in range(n)], moment)
        self._coefficients[region] = coefficients
        return coefficients


class StepCostModel:
    """A worker's fitted step time; `observe` each finished step, `predict_ms` a planned one."""

    def __init__(self) -> None:
        self._fit = OnlineFit(_NUM_TERMS, MIN_STEPS, _NUM_REGIONS)
        self.last_predicted_ms: float | None = None  # what the model said of the last step before it was observed
        self.last_measured_ms: float | None = None
        self.abs_error_ms = 0.0  # a moving average of |predicted - measured|, over the steps it predicted
        self.predicted_ms = 0.0  # moving averages of what it predicted and what was measured, over the same steps
        self.measured_ms = 0.0

    @property
    def num_steps(self) -> int:
        return self._fit.num_samples

    def observe_warm_up(self, shape: StepShape, duration_ms: float) -> None:
        """A step the worker timed at warm-up: it stays in the fit (at the speed served steps show since)."""
        if duration_ms >= 0.0:
            self._fit.observe_lasting(shape.terms(), duration_ms)

    def observe(self, shape: StepShape, duration_ms: float) -> None:
        if not duration_ms >= 0.0:  # NaN or negative: a clock that cannot be believed
            return
        predicted = self.predict_ms(shape)
        if predicted is not None:
            self.abs_error_ms = FORGET * self.abs_error_ms + (1 - FORGET) * abs(predicted - duration_ms)
            self.predicted_ms = FORGET * self.predicted_ms + (1 - FORGET) * predicted
            self.measured_ms = FORGET * self.measured_ms + (1 - FORGET) * duration_ms
        self.last_predicted_ms, self.last_measured_ms = predicted, duration_ms
        self._fit.observe(shape.terms(), duration_ms, region_of(shape))

    def predict_ms(self, shape: StepShape) -> float | None:
        """The expected time of a step of this shape; None until MIN_STEPS steps were seen."""
        return self._fit.predict(shape.terms(), region_of(shape))

    def coefficients(self) -> list[float] | None:
        """(fixed ms, ms per decode row up to 8, from 9 to 32 and beyond 32, ms more per row under a grammar, ms per
        prefill token, ms per thousand attended positions), each at least 0; None before MIN_STEPS steps."""
        return self._fit.coefficients()

    def row_ms(self, base_rows: int, extra_rows: int) -> float:
        """What each of `extra_rows` more decode rows costs, on average, in a step that has `base_rows` (0 before the
        model predicts)."""
        coefficients = self.coefficients()
        if coefficients is None or extra_rows <= 0:
            return 0.0
        before, after = row_terms(base_rows), row_terms(base_rows + extra_rows)
        return sum(c * (b - a) for c, a, b in zip(coefficients[1:4], before, after)) / extra_rows

    def extra_ms(self, num_drafts: int, context: int, row_ms: float, constrained: bool = False) -> float:
        """What `num_drafts` more rows after a decoding sequence's last token, `context` positions in (under a grammar
        where `constrained`), add to a step, at `row_ms` a row (`row_ms`)."""
        coefficients = self.coefficients()
        if coefficients is None or num_drafts <= 0:
            return 0.0
        # Its rows attend to (1 + k) * context + (1 + k)(2 + k)/2 positions, against context + 1 without drafts.
        attended = num_drafts * context + (num_drafts * num_drafts + 3 * num_drafts) // 2
        mask_ms = coefficients[4] * num_drafts if constrained else 0.0
        return row_ms * num_drafts + mask_ms + coefficients[6] * attended / 1000


class ProposeCostModel:
    """What waiting for proposals costs a step: a fixed part, a part per draft token of the longest proposal asked (a
    draft model or head runs once per position, every sequence at once) and a part per sequence asked for, fitted like
    a step's time to how much longer than a plain step's the target sat idle around each step that waited."""

    def __init__(self) -> None:
        self._fit = OnlineFit(3, 1)

    def observe(self, max_draft_tokens: int, num_seqs: int, waited_ms: float) -> None:
        if waited_ms >= 0.0:
            self._fit.observe((1.0, float(max_draft_tokens), float(num_seqs)), waited_ms)

    def predict_ms(self, max_draft_tokens: int, num_seqs: int) -> float:
        """0 before any answer was timed."""
        return self._fit.predict((1.0, float(max_draft_tokens), float(num_seqs))) or 0.0


def _fit_nonnegative(gram: list[list[float]], moment: list[float]) -> list[float]:
    """Least squares from its normal equations with every coefficient at least 0: no part of a step makes it faster,
    and where two terms move together (rows and the positions they attend to) an unconstrained fit can trade one for
    a negative other. A term that comes out negative is left out and the rest fitted again."""
    terms = list(range(len(moment)))
    while True:
        # The ridge is relative to each term's own weight, so terms of different units are pulled alike.
        solved = _solve(
            [[gram[i][j] * (1 + RIDGE) if i == j else gram[i][j] for j in terms] for i in terms],
            [moment[i] for i in terms],
        )
        negative = [term for term, value in zip(terms, solved) if value < 0.0]
        if not negative:
            coefficients = [0.0] * len(moment)
            for term, value in zip(terms, solved):
                coefficients[term] = value
            return coefficients
        terms.remove(min(negative, key=lambda term: solved[terms.index(term)]))


def _dot(coefficients: list[float], x: tuple[float, ...]) -> float:
    return sum(c * value for c, value in zip(coefficients, x))


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
