"""A target's step time learned from its steps: the fit recovers a machine's curve, follows it when it changes, and the
scheduler keeps one per worker, shown in GetServerInfo."""

from __future__ import annotations

import random

import pytest

from common.step_shape import StepShape, row_terms, step_shape
from scheduler.speculation.cost import MIN_STEPS, StepCostModel
from tests.unit.scheduler_fakes import Sim


# Fixed; ms a row up to 8, from 9 to 32, beyond; more a row under a grammar; a prefill token; 1000 positions.
CURVE = (8.0, 0.2, 0.9, 1.5, 0.6, 0.25, 0.04)


def true_ms(
    shape: StepShape,
    fixed: float,
    low: float,
    middle: float,
    high: float,
    per_constrained: float,
    per_prefill: float,
    per_kilo: float,
) -> float:
    rows = sum(slope * part for slope, part in zip((low, middle, high), row_terms(shape.decode_rows)))
    return (
        fixed
        + rows
        + per_constrained * shape.constrained_rows
        + per_prefill * shape.prefill_tokens
        + per_kilo * shape.attended / 1000
    )


def random_shape(rng: random.Random) -> StepShape:
    """A step of 1-16 decoding sequences with 0-6 drafts each, sometimes a prefill chunk, contexts of 10-1500."""
    seqs = [
        (1, rng.choice([0, 0, 2, 4, 6]), rng.randint(10, 1500), rng.random() < 0.2) for _ in range(rng.randint(1, 16))
    ]
    if rng.random() < 0.3:
        seqs.append((rng.randint(16, 256), 0, rng.choice([0, 256]), False))
    return step_shape(seqs)


def test_a_steps_shape_counts_decode_rows_prefill_tokens_and_attended_positions() -> None:
    shape = step_shape([(1, 3, 100, True), (5, 0, 20, False)])  # a decode verifying 3 drafts at 100 under a grammar;
    assert shape.constrained_rows == 4  # a 5-token chunk after 20
    assert (shape.decode_rows, shape.prefill_tokens) == (4, 5)
    assert shape.attended == (101 + 102 + 103 + 104) + (21 + 22 + 23 + 24 + 25)


def test_the_fit_recovers_the_curve_it_is_fed_and_predicts_nothing_before_it_has_seen_enough() -> None:
    rng = random.Random(3)
    model = StepCostModel()
    curve = CURVE
    for index in range(200):
        shape = random_shape(rng)
        if index < MIN_STEPS:
            assert model.predict_ms(shape) is None
        model.observe(shape, true_ms(shape, *curve) * rng.uniform(0.97, 1.03))  # a noisy clock
    fitted = model.coefficients()
    assert fitted is not None
    for got, want in zip(fitted, curve):
        assert got == pytest.approx(want, rel=0.15, abs=0.05)
    shape = step_shape([(1, 6, 800, False)] * 4)
    assert model.predict_ms(shape) == pytest.approx(true_ms(shape, *curve), rel=0.05)
    assert model.abs_error_ms < 0.05 * true_ms(shape, *curve)


def test_the_fit_follows_a_machine_that_slows_down() -> None:
    """A busy neighbour arrives: within a few hundred steps of every shape (steps of each region forget their own
    kind at FORGET, the others' more slowly), the model predicts the new speed."""
    rng = random.Random(4)
    model = StepCostModel()
    for shape in warm_up_shapes():
        model.observe_warm_up(shape, true_ms(shape, *CURVE))
    for _ in range(150):
        shape = random_shape(rng)
        model.observe(shape, true_ms(shape, *CURVE))
    for _ in range(300):
        shape = random_shape(rng)
        model.observe(shape, true_ms(shape, *CURVE) * 2)
    shape = step_shape([(1, 2, 300, False)] * 8)
    assert model.predict_ms(shape) == pytest.approx(2 * true_ms(shape, *CURVE), rel=0.05)


def test_a_clock_that_cannot_be_believed_is_ignored() -> None:
    model = StepCostModel()
    model.observe(step_shape([(1, 0, 10, False)]), float("nan"))
    model.observe(step_shape([(1, 0, 10, False)]), -1.0)
    assert model.num_steps == 0


def test_the_scheduler_fits_each_workers_steps_and_shows_the_fit() -> None:
    sim = Sim()
    worker = sim.worker("w0").start()
    for index in range(MIN_STEPS + 2):
        sim.submit(f"r{index}", max_tokens=3)
    worker.run()
    process = next(p for p in sim.info().processes if p.process_id == "w0")
    assert process.num_costed_steps >= MIN_STEPS
    fitted = (
        process.step_fixed_ms,
        process.step_ms_per_row,
        process.step_ms_per_prefill_token,
        process.step_ms_per_kilo_context,
    )
    assert all(value == value for value in fitted)  # (solved: no NaN; the fake's steps all take the same time)


def test_no_part_of_a_step_is_fitted_as_making_it_faster() -> None:
    """Rows and the positions they attend to move together; a clock that only counts attention must not give rows a
    negative cost to make up for it."""
    rng = random.Random(5)
    model = StepCostModel()
    for _ in range(100):
        shape = random_shape(rng)
        model.observe(shape, (5.0 + 0.01 * shape.attended / 1000 - 0.3 * shape.decode_rows) * rng.uniform(0.9, 1.1))
    fitted = model.coefficients()
    assert fitted is not None and min(fitted) >= 0.0


def test_a_verify_steps_few_rows_are_priced_where_the_step_stands_on_the_curve() -> None:
    """Rows nearly free up to 8 (a step bound by reading the weights), dear beyond: one line through every step would
    price a single sequence's drafts at what rows cost in a step of 64."""
    rng = random.Random(6)
    model = StepCostModel()
    for _ in range(300):
        model.observe(shape := random_shape(rng), true_ms(shape, *CURVE))
    assert model.row_ms(1, 6) == pytest.approx(0.2, rel=0.15)  # one sequence verifying 6 drafts
    assert model.row_ms(40, 24) == pytest.approx(1.5, rel=0.15)  # a step of 40 rows taking 24 more
    assert model.row_ms(4, 8) == pytest.approx((4 * 0.2 + 4 * 0.9) / 8, rel=0.15)  # across the first knot
    assert model.extra_ms(6, 1000, 0.2) == pytest.approx(6 * 0.2 + CURVE[6] * (6 * 1000 + 27) / 1000, rel=0.15)
    assert model.extra_ms(6, 1000, 0.2, constrained=True) - model.extra_ms(6, 1000, 0.2) == pytest.approx(
        6 * 0.6, rel=0.15
    )


def warm_up_shapes() -> list[StepShape]:
    """The shapes a worker times at warm-up (gpu_worker/runner.py): 8 sequences, then each verifying 8 drafts; one
    sequence, then verifying 8; the same one after a long context."""
    return [
        step_shape([(1, 0, 1, False)] * 8),
        step_shape([(1, 8, 1, False)] * 8),
        step_shape([(1, 0, 1, False)]),
        step_shape([(1, 8, 1, False)]),
        step_shape([(1, 0, 511, False)]),
        step_shape([(1, 8, 503, False)]),
    ]


@pytest.mark.parametrize("speed", [1.0, 0.8, 2.0])
def test_what_served_steps_cannot_tell_apart_the_warm_up_says_at_the_speed_served_now(speed: float) -> None:
    """A server at one sequence runs only one-row steps: the fixed part and a row's cost move together in them. The
    warm-up's verify steps keep what a draft row costs, at the speed the served steps show (a neighbour that arrived
    since start-up doubles both), however many one-row steps come."""
    model = StepCostModel()
    for shape in warm_up_shapes():
        model.observe_warm_up(shape, true_ms(shape, *CURVE))
    one_row = step_shape([(1, 0, 200, False)])
    for _ in range(1000):
        model.observe(one_row, true_ms(one_row, *CURVE) * speed)
    assert model.row_ms(1, 6) == pytest.approx(CURVE[1] * speed, rel=0.2)
    assert model.predict_ms(one_row) == pytest.approx(true_ms(one_row, *CURVE) * speed, rel=0.02)
    verify = step_shape([(1, 6, 200, False)])
    assert model.predict_ms(verify) == pytest.approx(true_ms(verify, *CURVE) * speed, rel=0.1)


def test_served_steps_outweigh_the_warm_up_where_they_say_something_else() -> None:
    """Rows that turn out dearer in service than at warm-up (another process's cache pressure, say) are priced at what
    service shows once verify steps have run: one sequence, verifying 0-6 drafts."""
    rng = random.Random(8)
    model = StepCostModel()
    for shape in warm_up_shapes():
        model.observe_warm_up(shape, true_ms(shape, *CURVE))
    served = (CURVE[0], 3 * CURVE[1], *CURVE[2:])
    for _ in range(300):
        shape = step_shape([(1, rng.choice([0, 0, 2, 4, 6]), rng.randint(10, 1500), False)])
        model.observe(shape, true_ms(shape, *served))
    assert model.row_ms(1, 6) == pytest.approx(3 * CURVE[1], rel=0.2)


def test_a_run_of_full_steps_leaves_what_a_one_row_step_costs_known() -> None:
    """One sequence for a while, then 64 at once, whose steps the model does not fit well (here they run 30% slower
    than its curve says, their rows and contexts moving together): afterwards a one-row step is still priced at about
    what it cost, and a draft row at about what it adds."""
    rng = random.Random(11)
    model = StepCostModel()
    for shape in warm_up_shapes():
        model.observe_warm_up(shape, true_ms(shape, *CURVE))
    for position in range(200):
        shape = step_shape([(1, rng.choice([0, 0, 2, 6]), 100 + position, False)])
        model.observe(shape, true_ms(shape, *CURVE))
    for step in range(200):
        rows = max(64 - step // 3, 2)
        shape = step_shape([(1, 0, 300 + step + 5 * i, False) for i in range(rows)])
        model.observe(shape, true_ms(shape, *CURVE) * 1.3 + rng.uniform(-2.0, 2.0))
    alone = step_shape([(1, 0, 400, False)])
    assert model.predict_ms(alone) == pytest.approx(true_ms(alone, *CURVE), rel=0.25)
    assert model.row_ms(1, 6) == pytest.approx(CURVE[1], abs=0.2)
