"""Continuous batching: select_seqs and plan_step as pure functions,
then the same rules seen through SchedulerCore's steps."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proto.lifecycle import State
from proto.messages import SamplingParams
from scheduler.batching import BatchLimits, ScheduledSeq, plan_step, select_seqs
from scheduler.requests import Request
from tests.unit.scheduler_fakes import DEFAULT_TOKEN, Sim, prompt


def request(request_id: str, num_prompt: int, *, num_output: int = 0, num_computed: int | None = None) -> Request:
    """A running request; by default everything but the last output token (or the whole prompt) is uncomputed."""
    r = Request(
        request_id=request_id,
        gateway=b"gw",
        prompt_token_ids=prompt(num_prompt),
        max_tokens=100,
        sampling=SamplingParams(),
        stop_token_ids=frozenset(),
        waiting_since_s=0.0,
        output_token_ids=[DEFAULT_TOKEN] * num_output,
    )
    r.num_computed_tokens = (r.num_tokens - 1 if num_output else 0) if num_computed is None else num_computed
    return r


def decode(request_id: str) -> Request:
    return request(request_id, 5, num_output=2)


def as_tuples(plan: list[ScheduledSeq]) -> list[tuple[str, int, bool]]:
    return [(s.request.request_id, s.num_tokens, s.completes) for s in plan]


def apply(plan: list[ScheduledSeq]) -> None:
    """What the core does with a step's result: computed tokens catch up; a completing seq gains a token."""
    for s, completes in [(s, s.completes) for s in plan]:  # `completes` reads live state: take it first
        s.request.num_computed_tokens += s.num_tokens
        if completes:
            s.request.output_token_ids.append(DEFAULT_TOKEN)


LIMITS = BatchLimits(max_num_batched_tokens=16, max_num_seqs=4)

# ---------------------------------------------------------------- select_seqs and plan_step, pure


def test_a_plan_is_frozen_with_the_draft_tokens_decided_for_its_seqs() -> None:
    running = [request("p", 4), decode("d")]
    seen: list[list[str]] = []

    def draft_tokens(seqs: list[ScheduledSeq]) -> dict[str, int]:
        seen.append([s.request.request_id for s in seqs])
        return {"d": 3}

    plan = plan_step(running, LIMITS, draft_tokens)
    assert plan is not None and seen == [["d", "p"]]
    assert as_tuples(list(plan.seqs)) == [("d", 1, True), ("p", 4, True)]
    assert plan.num_draft_tokens == {"d": 3} and plan.waits_for_proposals
    assert plan_step([], LIMITS, draft_tokens) is None and len(seen) == 1  # nothing to run: no decision asked
    assert not plan_step(running, LIMITS, lambda seqs: {}).waits_for_proposals  # type: ignore[union-attr]


def test_nothing_running_plans_nothing() -> None:
    assert select_seqs([], LIMITS) == []


def test_a_short_prompt_is_prefilled_whole_and_sampled() -> None:
    assert as_tuples(select_seqs([request("a", 5)], LIMITS)) == [("a", 5, True)]


def test_decodes_go_before_prefills_whatever_the_placement_order() -> None:
    running = [request("p1", 4), decode("d1"), request("p2", 3), decode("d2")]
    assert as_tuples(select_seqs(running, LIMITS)) == [
        ("d1", 1, True),
        ("d2", 1, True),
        ("p1", 4, True),
        ("p2", 3, True),
    ]


def test_the_token_budget_chunks_a_long_prompt_until_computed_catches_up() -> None:
    long = request("long", 40)
    chunks = []
    for _ in range(10):
        if long.output_token_ids:
            break
        plan = select_seqs([long], LIMITS)
        chunks.append(as_tuples(plan))
        apply(plan)
    assert chunks == [[("long", 16, False)], [("long", 16, False)], [("long", 8, True)]]
    assert long.num_computed_tokens == 40 and long.num_tokens == 41
    assert as_tuples(select_seqs([long], LIMITS)) == [("long", 1, True)]


def test_a_chunk_that_does_not_complete_the_prompt_does_not_sample() -> None:
    (chunk,) = select_seqs([request("long", 17)], LIMITS)
    assert chunk.num_tokens == 16
    assert not chunk.completes


def test_decodes_take_their_share_of_the_budget_first_and_a_prompt_gets_the_rest() -> None:
    running = [request("long", 30), decode("d1"), decode("d2")]
    assert as_tuples(select_seqs(running, LIMITS)) == [("d1", 1, True), ("d2", 1, True), ("long", 14, False)]


def test_the_budget_stops_the_batch_once_spent() -> None:
    running = [request("p1", 16), request("p2", 3)]
    assert as_tuples(select_seqs(running, LIMITS)) == [("p1", 16, True)]


def test_max_num_seqs_caps_the_batch_in_placement_order() -> None:
    running = [decode(f"d{i}") for i in range(6)]
    assert [s.request.request_id for s in select_seqs(running, LIMITS)] == ["d0", "d1", "d2", "d3"]


def test_a_fully_computed_request_is_not_scheduled() -> None:
    done = request("done", 5, num_output=1, num_computed=6)
    assert select_seqs([done, decode("d")], LIMITS) == select_seqs([decode("d")], LIMITS)
    assert select_seqs([done], LIMITS) == []


def test_a_request_recomputed_after_a_worker_loss_is_prefilled_from_prompt_and_output() -> None:
    resumed = request("r", 10, num_output=3, num_computed=0)
    assert as_tuples(select_seqs([resumed], LIMITS)) == [("r", 13, True)]


def test_continuous_batching_a_new_request_joins_and_a_finished_one_leaves() -> None:
    a, b = decode("a"), decode("b")
    running = [a, b]
    apply(select_seqs(running, LIMITS))
    running.append(request("c", 6))  # arrives while a and b decode
    assert as_tuples(select_seqs(running, LIMITS)) == [("a", 1, True), ("b", 1, True), ("c", 6, True)]
    apply(select_seqs(running, LIMITS))
    running.remove(a)  # a finished
    assert as_tuples(select_seqs(running, LIMITS)) == [("b", 1, True), ("c", 1, True)]


@st.composite
def running_sets(draw: st.DrawFn) -> list[Request]:
    requests = []
    for i in range(draw(st.integers(0, 12))):
        num_prompt = draw(st.integers(1, 60))
        num_output = draw(st.integers(0, 5))
        num_tokens = num_prompt + num_output
        num_computed = draw(st.integers(0, num_tokens - 1))
        requests.append(request(f"r{i}", num_prompt, num_output=num_output, num_computed=num_computed))
    return requests


@given(running_sets(), st.integers(1, 64), st.integers(1, 8))
def test_every_plan_respects_the_limits_and_the_rules(running: list[Request], budget: int, max_num_seqs: int) -> None:
    plan = select_seqs(running, BatchLimits(budget, max_num_seqs))
    ids = [s.request.request_id for s in plan]
    assert len(ids) == len(set(ids)) <= max_num_seqs
    assert sum(s.num_tokens for s in plan) <= budget
    for s in plan:
        assert 1 <= s.num_tokens <= s.request.num_uncomputed_tokens
        assert s.completes == (s.num_tokens == s.request.num_uncomputed_tokens)
    # decodes first, each group in placement order
    decodes = [r.request_id for r in running if r.num_uncomputed_tokens == 1]
    prefills = [r.request_id for r in running if r.num_uncomputed_tokens > 1]
    assert ids == (decodes + prefills)[: len(ids)]
    # greedy: something is left out only when the budget or the seat count ran out
    if len(ids) < len(running):
        assert sum(s.num_tokens for s in plan) == budget or len(ids) == max_num_seqs
    # only the last sequence of a plan can be cut short
    assert all(s.completes for s in plan[:-1])


# ---------------------------------------------------------------- the same rules through SchedulerCore


def test_core_chunks_a_long_prompt_over_several_steps_and_samples_only_at_the_end() -> None:
    sim = Sim(max_num_batched_tokens=16)
    worker = sim.worker().start()
    sim.submit("long", prompt(40), max_tokens=2)
    worker.run()
    seqs = [(s.start_position, len(s.token_ids), s.sample) for s in worker.seqs_of("long")]
    assert seqs == [(0, 16, False), (16, 16, False), (32, 8, True), (40, 1, True)]
    assert [t for s in worker.seqs_of("long") for t in s.token_ids] == prompt(40) + [DEFAULT_TOKEN]
    assert sim.streamed("long") == [DEFAULT_TOKEN, DEFAULT_TOKEN]


def test_core_puts_decodes_first_and_gives_a_new_prompt_the_rest_of_the_budget() -> None:
    sim = Sim(max_num_batched_tokens=16)
    worker = sim.worker().start()
    sim.submit("a", prompt(4), max_tokens=10)
    worker.complete()  # a's prefill; its first decode is now in flight
    sim.submit("long", prompt(30), max_tokens=1)  # arrives while a decodes
    worker.complete()
    assert [(s.request_id, s.start_position, len(s.token_ids), s.sample) for s in worker.step().seqs] == [
        ("a", 5, 1, True),
        ("long", 0, 15, False),
    ]


def test_core_continuous_batching_a_newcomer_joins_the_next_step_and_a_finished_one_leaves() -> None:
    sim = Sim()
    worker = sim.worker().start()
    sim.submit("a", prompt(3), max_tokens=2)
    sim.submit("b", prompt(3, first=200), max_tokens=6)  # placed, waits for a's step to return
    assert [s.request_id for s in worker.step().seqs] == ["a"]
    worker.complete()
    assert [(s.request_id, s.start_position) for s in worker.step().seqs] == [("a", 3), ("b", 0)]
    sim.submit("c", prompt(5, first=300), max_tokens=3)  # arrives while a and b run
    worker.complete()  # a reaches max_tokens=2 and finishes
    assert sim.finish_reason("a") == "length"
    assert [(s.request_id, s.start_position) for s in worker.step().seqs] == [("b", 3), ("c", 0)]
    worker.run()
    assert [sim.finish_reason(r) for r in "abc"] == ["length"] * 3


def test_core_never_puts_more_than_max_num_seqs_in_a_step() -> None:
    sim = Sim(max_num_seqs=2)
    worker = sim.worker(num_kv_slots=4)
    worker.start(until=State.WARMING)
    for rid in "abc":
        sim.submit(rid, prompt(3), max_tokens=2)
    worker.report(State.READY)
    worker.run()
    steps = worker.all_steps()
    assert max(len(s.seqs) for s in steps) == 2
    assert [[s.request_id for s in step.seqs] for step in steps] == [["a", "b"], ["a", "b"], ["c"], ["c"]]
    assert all(sim.finish_reason(r) == "length" for r in "abc")
