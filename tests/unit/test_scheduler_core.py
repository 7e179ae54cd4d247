"""SchedulerCore through its public methods: placement, streaming, KV budget, aborts, errors, seeds, worker loss.

Workers are simulated with the messages a real one sends (tests/unit/scheduler_fakes.py);
every StepRequest a fake worker receives is checked against its model of the KV pages.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import msgspec
import pytest

from proto import messages as m
from proto.lifecycle import State
from scheduler.outbox import Outgoing
from scheduler.hellos import MAX_KERNELS_CHARS
from tests.unit.scheduler_fakes import DEFAULT_TOKEN, EOS, GATEWAY, FakeWorker, Sim, assert_all_free, prompt


def ready(sim: Sim, worker_id: str = "w0", **hello: object) -> FakeWorker:
    return sim.worker(worker_id, identity=None, **hello).start()


def assert_stream(sim: Sim, request_id: str, tokens: list[int], finish_reason: str, num_prompt_tokens: int) -> None:
    """The deltas carry exactly `tokens` in order, running usage counts, and only the last one finishes."""
    deltas = sim.deltas(request_id)
    assert sim.streamed(request_id) == tokens
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [finish_reason]
    assert all(d.num_prompt_tokens == num_prompt_tokens for d in deltas)
    counts, total = [], 0
    for d in deltas:
        total += len(d.token_ids)
        counts.append(total)
    assert [d.num_completion_tokens for d in deltas] == counts


def steps_to(worker: FakeWorker) -> list[list[str]]:
    return [[s.request_id for s in step.seqs] for step in worker.all_steps()]


# ---------------------------------------------------------------- only READY workers run steps


@pytest.mark.parametrize("stage", [State.STARTING, State.LOADING, State.ALLOCATING, State.WARMING])
def test_nothing_is_dispatched_to_a_worker_that_is_not_ready(stage: State) -> None:
    sim = Sim()
    worker = sim.worker().start(until=stage)
    sim.submit("a")
    assert worker.all_steps() == []
    assert (sim.core.num_waiting, sim.core.num_running) == (1, 0)
    assert not sim.core.has_ready_target()
    worker.boot(State.READY)
    assert steps_to(worker) == [["a"]]
    assert (sim.core.num_waiting, sim.core.num_running) == (0, 1)


def test_a_worker_that_failed_during_init_never_gets_a_step() -> None:
    sim = Sim()
    worker = sim.worker().start(until=State.LOADING)
    worker.fail("model.safetensors: no such file")
    sim.submit("a")
    assert not worker.report(State.READY)  # a FAILED incarnation is not heard any more
    assert worker.all_steps() == []
    assert sim.core.num_waiting == 1
    process = sim.process("w0")
    assert process.state == "FAILED"
    assert process.failure == "LOADING: RuntimeError: model.safetensors: no such file"


def test_has_ready_target_follows_the_lifecycle() -> None:
    sim = Sim()
    worker = sim.worker().start(until=State.WARMING)
    assert not sim.core.has_ready_target()
    worker.boot()
    assert sim.core.has_ready_target()
    worker.fail()
    assert not sim.core.has_ready_target()


# ---------------------------------------------------------------- steps and streaming


def test_each_step_starts_every_sequence_at_its_computed_tokens() -> None:
    sim = Sim()
    worker = ready(sim)
    sim.submit("a", prompt(5), max_tokens=3)
    worker.run({"a": [11, 12, 13]})
    assert [(s.start_position, s.token_ids, s.sample, s.pages) for s in worker.seqs_of("a")] == [
        (0, prompt(5), True, [0]),
        (5, [11], True, [0]),
        (6, [12], True, [0]),
    ]


def test_tokens_stream_in_order_and_the_last_delta_finishes_with_length_at_max_tokens() -> None:
    sim = Sim()
    worker = ready(sim)
    sim.submit("a", prompt(4), max_tokens=4)
    worker.run({"a": [11, 12, 13, 14, 15]})
    assert_stream(sim, "a", [11, 12, 13, 14], "length", num_prompt_tokens=4)
    assert len(worker.all_steps()) == 4


def test_a_stop_token_finishes_with_stop() -> None:
    sim = Sim()
    worker = ready(sim)
    sim.submit("a", prompt(3), max_tokens=10, stop_token_ids=[EOS, 9])
    worker.run({"a": [11, 9, 12]})
    assert_stream(sim, "a", [11, 9], "stop", num_prompt_tokens=3)
    assert len(worker.all_steps()) == 2


def test_max_tokens_none_fills_the_context_and_finishes_with_length_at_max_model_len() -> None:
    sim = Sim(max_model_len=16)
    worker = ready(sim)
    sim.submit("a", prompt(11), max_tokens=None)
    worker.run()
    assert_stream(sim, "a", [DEFAULT_TOKEN] * 5, "length", num_prompt_tokens=11)
    assert max(s.start_position + len(s.token_ids) for s in worker.seqs_of("a")) == 15  # the 16th is never fed back


def test_several_tokens_from_one_step_are_cut_at_the_stop_token() -> None:
    sim = Sim()
    worker, draft = ready(sim), sim.draft().start()
    sim.submit("a", prompt(3), max_tokens=10)
    worker.complete({"a": [10]})
    draft.answer({"a": [11, 12, EOS, 13]})
    worker.complete({"a": [11, 12, EOS, 13, 14]})
    assert_stream(sim, "a", [10, 11, 12, EOS], "stop", num_prompt_tokens=3)
    assert worker.pending_step() is None
    assert draft.forgotten() == ["a"]


def test_a_step_result_with_more_tokens_than_drafts_plus_one_loses_the_worker() -> None:
    sim = Sim()
    worker = ready(sim)
    sim.submit("a", prompt(3), max_tokens=10)
    step = worker.step()
    worker.send(m.StepResult("w0", 1, step.step_id, [m.SeqOutput("a", [11, 12, 13])], 3.0))
    assert sim.process("w0").state == "FAILED"
    assert "3 tokens with 0 accepted of 0 drafts" in sim.process("w0").failure
    assert sim.streamed("a") == []


def test_deltas_go_to_the_gateway_that_submitted() -> None:
    sim = Sim()
    worker = ready(sim)
    sim.submit("a", max_tokens=1)
    worker.run()
    assert {o.identity for o in sim.sent if not o.to_worker} == {GATEWAY}


# ---------------------------------------------------------------- placement


def test_least_loaded_placement_across_two_ready_workers_and_a_request_stays_on_its_worker() -> None:
    sim = Sim()
    w0, w1 = ready(sim, "w0"), ready(sim, "w1")
    for rid in "abcd":
        sim.submit(rid, prompt(3), max_tokens=3)
    w0.run()
    w1.run()
    assert {r for step in steps_to(w0) for r in step} == {"a", "c"}
    assert {r for step in steps_to(w1) for r in step} == {"b", "d"}
    assert [p.num_running for p in sim.info().processes] == [0, 0]
    sim.submit("e", max_tokens=1)  # both idle: a tie goes to the first registered
    assert steps_to(w0)[-1] == ["e"]
    w0.run()
    assert_all_free(sim, w0, w1)


def test_placement_prefers_the_worker_with_fewer_requests() -> None:
    sim = Sim()
    w0 = ready(sim, "w0")
    sim.submit("a", max_tokens=5)
    sim.submit("b", max_tokens=5)
    w1 = ready(sim, "w1")  # w0 holds two, w1 none
    sim.submit("c", max_tokens=1)
    assert steps_to(w1) == [["c"]]
    w0.run(), w1.run()
    assert_all_free(sim, w0, w1)


# ---------------------------------------------------------------- KV budget


def test_with_two_pages_a_third_request_waits_until_one_finishes_then_gets_the_freed_page() -> None:
    sim = Sim()
    worker = ready(sim, num_kv_slots=2)  # two pages, each a whole sequence
    sim.submit("a", prompt(3), max_tokens=2)
    sim.submit("b", prompt(3, first=200), max_tokens=6)
    sim.submit("c", prompt(3, first=300), max_tokens=2)
    assert (sim.core.num_waiting, sim.core.num_running) == (1, 2)
    worker.complete()
    assert steps_to(worker)[-1] == ["a", "b"]
    pages_a = worker.pages_of("a")
    worker.complete()  # a finishes: its page is free again and c takes it
    assert sim.finish_reason("a") == "length"
    assert steps_to(worker)[-1] == ["b", "c"]
    first_c = worker.seqs_of("c")[0]
    assert (first_c.pages, first_c.start_position) == (pages_a, 0)
    assert (sim.core.num_waiting, sim.core.num_running) == (0, 2)
    worker.run()
    assert_all_free(sim, worker)


def test_every_finished_request_frees_its_pages_and_all_pages_are_free_at_the_end() -> None:
    sim = Sim()
    worker = ready(sim, num_kv_slots=3)
    for i in range(7):
        sim.submit(f"r{i}", prompt(2 + i), max_tokens=1 + i % 3, stop_token_ids=[EOS])
    worker.run({"r1": [11, EOS], "r4": [EOS]})
    assert all(sim.finish_reason(f"r{i}") in ("stop", "length") for i in range(7))
    assert_all_free(sim, worker)


# ---------------------------------------------------------------- aborts


def test_aborting_a_waiting_request_removes_it_silently() -> None:
    sim = Sim()
    sim.submit("a")
    sent = sim.abort("a")
    assert sent == []
    assert (sim.core.num_waiting, sim.core.num_running) == (0, 0)
    worker = ready(sim)
    assert worker.all_steps() == []
    assert sim.to_gateway() == []


def test_aborting_a_running_request_frees_its_pages_at_once_even_while_its_step_is_in_flight() -> None:
    sim = Sim()
    worker = ready(sim)
    sim.submit("a", prompt(3), max_tokens=10)
    sim.submit("b", prompt(3, first=200), max_tokens=3)
    worker.complete({"a": [11]})
    assert worker.pending_step() is not None  # a (and b) in flight
    sent = sim.abort("a")
    assert sent == []  # the scheduler owns the pages: nothing to tell the worker
    assert sim.core.num_running == 1
    assert sim.info().processes[0].num_used_kv_pages == 1  # b's
    assert worker.complete({"a": [12], "b": [21]})  # the late result: accepted for b, ignored for a
    assert sim.streamed("a") == [11]
    assert all(d.finish_reason is None for d in sim.deltas("a"))  # the gateway asked: no "abort" delta
    assert all("a" not in step for step in steps_to(worker)[2:])
    worker.run({"b": [22, 23]})
    assert_stream(sim, "b", [21, 22, 23], "length", num_prompt_tokens=3)
    assert_all_free(sim, worker)


def test_aborting_frees_a_page_for_a_waiting_request() -> None:
    sim = Sim()
    worker = ready(sim, num_kv_slots=1)
    sim.submit("a", max_tokens=10)
    sim.submit("b", max_tokens=1)
    assert sim.core.num_waiting == 1
    sim.abort("a")
    worker.complete()  # a's step returns; b gets the page
    assert steps_to(worker)[-1] == ["b"]
    assert worker.seqs_of("b")[0].pages == [0]
    worker.run()
    assert sim.finish_reason("b") == "length"
    assert_all_free(sim, worker)


def test_a_page_freed_by_an_abort_while_its_step_waits_for_a_proposal_goes_to_a_waiting_request() -> None:
    sim = Sim()
    worker = sim.worker("w0", num_kv_slots=1).start()
    draft = sim.draft("d0").start()
    sim.submit("a", prompt(3), max_tokens=10)
    worker.complete({"a": [11]})
    assert draft.pending_propose() is not None  # a's decode waits for the draft
    sim.submit("b", prompt(3, first=50), max_tokens=2)
    assert sim.core.num_waiting == 1  # no free page
    sim.abort("a")
    assert sim.core.num_waiting == 0  # b took a's page at once
    draft.answer()  # the step that waited has nothing left of a: b's runs instead
    worker.run({"b": [60, 61]})
    assert_stream(sim, "b", [60, 61], "length", num_prompt_tokens=3)


def test_aborting_an_unknown_or_finished_request_does_nothing() -> None:
    sim = Sim()
    worker = ready(sim)
    sim.submit("a", max_tokens=1)
    worker.run()
    before = sim.info()
    assert sim.abort("a") == []
    assert sim.abort("never-seen") == []
    assert sim.info() == before


def test_a_late_result_for_an_aborted_request_is_not_credited_to_a_new_request_with_the_same_id() -> None:
    sim = Sim()
    worker = ready(sim)
    sim.submit("a", prompt(3), max_tokens=10)  # step 1 (a's prefill) in flight
    sim.abort("a")
    sim.submit("a", prompt(6, first=500), max_tokens=2)  # the client retries with its own request_id
    worker.complete({"a": [99]})  # step 1's result for the aborted request
    assert sim.streamed("a") == []
    worker.run({"a": [11, 12]})
    assert sim.streamed("a") == [11, 12]
    assert worker.seqs_of("a")[1].token_ids == prompt(6, first=500)


# ---------------------------------------------------------------- errors


def test_prompt_plus_max_tokens_past_max_model_len_is_invalid_and_names_both_numbers() -> None:
    sim = Sim(max_model_len=64)
    sim.submit("a", prompt(60), max_tokens=10)
    (error,) = sim.errors("a")
    assert error.code == "INVALID_ARGUMENT"
    assert "60" in error.message and "10" in error.message and "64" in error.message
    sim.submit("b", prompt(60), max_tokens=4)  # exactly the context: fine
    assert sim.errors("b") == []


@pytest.mark.parametrize(
    ("prompt_token_ids", "max_tokens"), [([], 4), (prompt(3), 0), (prompt(3), -1), (prompt(64), None)]
)
def test_other_invalid_requests_are_refused(prompt_token_ids: list[int], max_tokens: int | None) -> None:
    sim = Sim(max_model_len=64)
    sim.submit("a", prompt_token_ids, max_tokens=max_tokens)
    assert [e.code for e in sim.errors("a")] == ["INVALID_ARGUMENT"]
    assert sim.core.num_waiting == 0


def test_a_full_queue_refuses_with_resource_exhausted() -> None:
    sim = Sim(max_queue_len=2)
    sim.submit("a")
    sim.submit("b")
    sim.submit("c")
    assert [(e.request_id, e.code) for e in sim.errors()] == [("c", "RESOURCE_EXHAUSTED")]
    assert sim.core.num_waiting == 2


def test_the_queue_limit_counts_waiting_requests_only() -> None:
    sim = Sim(max_queue_len=1)
    ready(sim, num_kv_slots=4)
    for rid in "abcd":
        sim.submit(rid)
    assert sim.errors() == []
    assert (sim.core.num_waiting, sim.core.num_running) == (0, 4)


def test_a_duplicate_request_id_is_invalid_while_waiting_and_while_running_but_free_after_finishing() -> None:
    sim = Sim()
    sim.submit("a", max_tokens=2)
    sim.submit("a", max_tokens=2)
    worker = ready(sim)
    sim.submit("a", max_tokens=2)
    assert [(e.code, "already in use" in e.message) for e in sim.errors("a")] == [("INVALID_ARGUMENT", True)] * 2
    worker.run({"a": [11, 12]})
    assert_stream(sim, "a", [11, 12], "length", num_prompt_tokens=3)  # the original is untouched
    sim.submit("a", max_tokens=1)
    assert len(sim.errors("a")) == 2
    worker.run()
    assert_all_free(sim, worker)


BAD_SUBMISSIONS: list[Callable[[Sim], list[Outgoing]]] = [
    lambda sim: sim.submit("a", max_tokens=2),  # duplicate of the running one
    lambda sim: sim.submit("w", max_tokens=2),  # duplicate of the waiting one
    lambda sim: sim.submit("x", prompt(60), max_tokens=10),
    lambda sim: sim.submit("y", [], max_tokens=1),
    lambda sim: sim.submit("z", max_tokens=0),
]


@pytest.mark.parametrize(
    "bad", BAD_SUBMISSIONS, ids=["dup-running", "dup-waiting", "too-long", "empty", "zero-max-tokens"]
)
def test_a_rejected_request_changes_no_state(bad: Callable[[Sim], list[Outgoing]]) -> None:
    sim = Sim()
    worker = ready(sim, num_kv_slots=1)
    sim.submit("a", prompt(3), max_tokens=2)
    sim.submit("w", prompt(3, first=200), max_tokens=2)  # waits for a's slot
    before = sim.info()
    sent = bad(sim)
    assert [type(o.message) for o in sent] == [m.RequestError]  # to the gateway, nothing to any worker
    assert sim.info() == before
    worker.run({"a": [11, 12], "w": [21, 22]})
    assert_stream(sim, "a", [11, 12], "length", num_prompt_tokens=3)
    assert_stream(sim, "w", [21, 22], "length", num_prompt_tokens=3)
    assert_all_free(sim, worker)


def test_no_ready_worker_fails_a_waiting_request_unavailable_after_the_timeout_and_not_before() -> None:
    sim = Sim(no_worker_timeout_s=10.0)
    loading = sim.worker().start(until=State.LOADING)  # a worker that is not READY does not count
    sim.submit("a")
    sim.advance(4.0)
    loading.heartbeat()
    sim.advance(6.0)  # exactly the timeout
    loading.heartbeat()
    assert sim.check_timeouts() == []
    sim.advance(0.01)
    sent = sim.check_timeouts()
    assert [o.message for o in sent] == sim.errors("a")
    assert [e.code for e in sim.errors("a")] == ["UNAVAILABLE"]
    assert "--no-worker-timeout-s" in sim.errors("a")[0].message
    assert sim.core.num_waiting == 0
    sim.advance(60.0)
    assert sim.to_gateway(sim.check_timeouts()) == []


def test_a_request_waiting_for_a_slot_on_a_ready_worker_does_not_time_out() -> None:
    sim = Sim(no_worker_timeout_s=10.0)
    worker = ready(sim, num_kv_slots=1)
    sim.submit("a", max_tokens=30)
    sim.submit("b", max_tokens=1)
    for _ in range(20):
        sim.advance(1.0)
        worker.complete()
        sim.check_timeouts()
    assert sim.errors() == []
    assert sim.core.num_waiting == 1
    worker.run()
    assert_all_free(sim, worker)


def test_the_no_worker_timeout_counts_only_time_without_a_ready_worker() -> None:
    sim = Sim(no_worker_timeout_s=10.0)
    worker = ready(sim, num_kv_slots=1)
    sim.submit("a", max_tokens=60)
    sim.submit("b", max_tokens=1)  # waits for a's slot while w0 is READY
    for _ in range(30):
        sim.advance(1.0)
        worker.complete()
    worker.fail()  # from now on no READY worker; both a and b wait
    sim.advance(1.0)
    sim.check_timeouts()
    assert sim.errors() == []  # only 1 s without a READY worker, far below 10 s


# ---------------------------------------------------------------- seeds


def seeds_of(worker: FakeWorker) -> dict[str, int]:
    return {s.request_id: s.sampling.seed for step in worker.all_steps() for s in step.seqs}


def run_with_rng(rng_seed: int) -> dict[str, int]:
    sim = Sim(rng=random.Random(rng_seed))
    worker = ready(sim)
    sampling = m.SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=0)
    sim.submit("a", sampling=sampling, seed_given=False)
    sim.submit("b", sampling=sampling, seed_given=False)
    sim.submit("c", sampling=m.SamplingParams(temperature=0.8, seed=42), seed_given=True)
    assert {s.request_id: s.sampling.temperature for s in worker.step().seqs} == {"a": 0.8}
    worker.run()
    return seeds_of(worker)


def test_a_request_without_a_seed_gets_a_random_one_and_a_given_seed_is_kept() -> None:
    seeds = run_with_rng(1234)
    assert seeds["c"] == 42
    assert seeds["a"] != seeds["b"]
    assert all(0 <= seeds[r] < 2**63 for r in "ab")
    assert run_with_rng(1234) == seeds  # drawn from the injected rng only
    assert run_with_rng(99)["a"] != seeds["a"]


def test_the_drawn_seed_keeps_the_other_sampling_params() -> None:
    sim = Sim(rng=random.Random(5))
    worker = ready(sim)
    sim.submit("a", sampling=m.SamplingParams(temperature=0.5, top_p=0.7, top_k=3), seed_given=False)
    sampling = worker.seqs_of("a")[0].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.5, 0.7, 3)


# ---------------------------------------------------------------- worker loss and recovery


def lose_by_worker_failed(sim: Sim, worker: FakeWorker) -> None:
    worker.fail("CUDA error: an illegal memory access")


def lose_by_reported_failure(sim: Sim, worker: FakeWorker) -> None:
    worker.report(State.FAILED)


def lose_by_step_refused(sim: Sim, worker: FakeWorker) -> None:
    worker.refuse_step()


def lose_by_heartbeat_timeout(sim: Sim, worker: FakeWorker) -> None:
    sim.advance(sim.config.heartbeat_timeout_s)
    sim.check_timeouts()
    assert sim.process(worker.worker_id).state == "READY"  # exactly the timeout: not yet
    sim.advance(0.01)
    sim.check_timeouts()


def lose_by_step_timeout(sim: Sim, worker: FakeWorker) -> None:
    for _ in range(int(sim.config.step_timeout_s)):  # alive and heartbeating, but the step never returns
        sim.advance(1.0)
        worker.heartbeat()
        sim.check_timeouts()
    assert sim.process(worker.worker_id).state == "READY"  # exactly the timeout: not yet
    sim.advance(0.5)
    worker.heartbeat()
    sim.check_timeouts()
    assert m.Drain(worker.incarnation) in worker.inbox()


LOSSES = {
    "worker_failed": (lose_by_worker_failed, "FAILED", "READY: RuntimeError: CUDA error: an illegal memory access"),
    "reported_failed": (lose_by_reported_failure, "FAILED", ""),
    "step_refused": (lose_by_step_refused, "FAILED", "refused a step: not READY"),
    "heartbeat_timeout": (lose_by_heartbeat_timeout, "DEAD", "--heartbeat-timeout-s"),
    "step_timeout": (lose_by_step_timeout, "DEAD", "--step-timeout-s"),
}


@pytest.mark.parametrize("loss", LOSSES)
def test_a_lost_workers_requests_are_recomputed_elsewhere_without_duplicate_or_missing_tokens(loss: str) -> None:
    lose, state, failure = LOSSES[loss]
    sim = Sim()
    w0 = ready(sim, "w0")
    sim.submit("a", prompt(4), max_tokens=6)
    sim.submit("b", prompt(3, first=200), max_tokens=5)
    w0.complete({"a": [10]})
    w0.complete({"a": [11], "b": [20]})
    w0.complete({"a": [12], "b": [21]})
    assert w0.pending_step() is not None  # the fourth step is in flight when the worker goes

    lose(sim, w0)
    assert (sim.core.num_waiting, sim.core.num_running) == (2, 0)
    process = sim.process("w0")
    assert (process.state, process.num_running) == (state, 0)
    assert failure in process.failure
    # Told to stop, once: one given up on while still alive would otherwise run on with nobody to serve.
    assert w0.inbox().count(m.Drain(w0.incarnation)) == 1
    assert not w0.complete({"a": [98], "b": [99]})  # the late result of a lost worker is dropped
    assert sim.streamed("a") == [10, 11, 12] and sim.streamed("b") == [20, 21]

    w1 = ready(sim, "w1")
    resent = w1.step()
    assert [(s.request_id, s.start_position, s.token_ids, s.sample) for s in resent.seqs] == [
        ("a", 0, prompt(4) + [10, 11, 12], True),
        ("b", 0, prompt(3, first=200) + [20, 21], True),
    ]
    w1.run({"a": [13, 14, 15], "b": [22, 23, 24]})
    assert_stream(sim, "a", [10, 11, 12, 13, 14, 15], "length", num_prompt_tokens=4)
    assert_stream(sim, "b", [20, 21, 22, 23, 24], "length", num_prompt_tokens=3)
    assert w0.all_steps()[-1].step_id < resent.step_id
    assert len(w0.all_steps()) == 4  # nothing more went to the lost worker
    assert_all_free(sim, w1)


def test_requests_of_a_lost_worker_move_to_another_ready_worker_at_once() -> None:
    sim = Sim()
    w0, w1 = ready(sim, "w0"), ready(sim, "w1")
    sim.submit("a", max_tokens=3)
    sim.submit("b", max_tokens=3)
    w0.complete()
    w0.fail()  # b's step is in flight on w1: a is placed there and joins its next step
    assert (sim.core.num_waiting, sim.process("w1").num_running) == (0, 2)
    w1.complete()
    assert [(s.request_id, s.start_position, s.token_ids) for s in w1.step().seqs] == [
        ("b", 3, [DEFAULT_TOKEN]),
        ("a", 0, [100, 101, 102, DEFAULT_TOKEN]),
    ]
    w1.run()
    assert [sim.finish_reason(r) for r in "ab"] == ["length", "length"]
    assert sim.streamed("a") == [DEFAULT_TOKEN] * 3
    assert_all_free(sim, w1)


def test_a_recomputed_request_is_chunked_by_the_token_budget() -> None:
    sim = Sim(max_num_batched_tokens=8)
    w0 = ready(sim, "w0")
    sim.submit("a", prompt(10), max_tokens=4)
    w0.complete()
    w0.complete({"a": [11]})  # two prefill chunks: [11] streamed, its decode in flight
    w0.fail()
    w1 = ready(sim, "w1")
    w1.run({"a": [13, 14, 15]})
    assert [(s.start_position, len(s.token_ids), s.sample) for s in w1.seqs_of("a")][:2] == [
        (0, 8, False),
        (8, 3, True),
    ]
    assert sim.streamed("a") == [11, 13, 14, 15]


def test_heartbeats_keep_a_worker_alive() -> None:
    sim = Sim()
    worker = ready(sim)
    for _ in range(10):
        sim.advance(4.0)
        worker.heartbeat(num_used_kv_pages=0)
        sim.check_timeouts()
    assert sim.process("w0").state == "READY"


def test_a_draining_worker_finishes_its_requests_gets_no_new_one_and_is_told_to_stop_when_empty() -> None:
    sim = Sim()
    w0 = ready(sim, "w0")
    sim.submit("a", prompt(3), max_tokens=4)
    w0.report(State.DRAINING)
    assert sim.process("w0").state == "DRAINING" and not sim.core.has_ready_target()  # health turns NOT_SERVING
    sim.submit("b", max_tokens=1)  # waits: nothing new goes to a draining worker
    w0.run({"a": [11, 12, 13, 14]})
    assert_stream(sim, "a", [11, 12, 13, 14], "length", num_prompt_tokens=3)
    assert all(s.request_id == "a" for step in w0.all_steps() for s in step.seqs)
    assert w0.inbox()[-1] == m.Drain(1)  # drained: it may stop
    w0.report(State.STOPPED)
    w1 = ready(sim, "w1")
    w1.run()
    assert sim.finish_reason("b") == "length"
    assert_all_free(sim, w1)


def test_a_worker_that_stops_while_draining_has_its_requests_recomputed_elsewhere() -> None:
    sim = Sim()
    w0 = ready(sim, "w0")
    sim.submit("a", prompt(3), max_tokens=4)
    w0.report(State.DRAINING)
    w0.complete({"a": [11]})
    w0.report(State.STOPPED)  # its --drain-timeout-s ran out
    assert sim.core.num_waiting == 1
    w1 = ready(sim, "w1")
    w1.run({"a": [12, 13, 14]})
    assert_stream(sim, "a", [11, 12, 13, 14], "length", num_prompt_tokens=3)


# ---------------------------------------------------------------- incarnations


def test_a_new_incarnation_replaces_the_old_and_the_old_ones_messages_are_dropped() -> None:
    sim = Sim()
    old = ready(sim, "w0")
    sim.submit("a", prompt(3), max_tokens=3)
    old.complete({"a": [11]})
    new = sim.worker("w0", incarnation=2)
    assert new.hello()
    (process,) = sim.info().processes
    assert (process.process_id, process.incarnation, process.state, process.num_running) == ("w0", 2, "STARTING", 0)
    assert sim.core.num_waiting == 1

    assert not old.heartbeat()
    assert not old.complete({"a": [99]})
    assert not old.report(State.READY)
    assert not old.fail()
    assert not old.hello()  # a stale hello
    assert not new.hello()  # a repeated one
    assert sim.streamed("a") == [11]

    new.boot()
    step = new.step()
    assert (step.incarnation, [(s.start_position, s.token_ids) for s in step.seqs]) == (2, [(0, prompt(3) + [11])])
    new.run({"a": [12, 13]})
    assert_stream(sim, "a", [11, 12, 13], "length", num_prompt_tokens=3)
    assert old.all_steps()[-1].step_id < step.step_id
    assert_all_free(sim, new)


def test_a_gone_worker_is_replaced_even_by_an_incarnation_that_reads_an_earlier_clock() -> None:
    sim = Sim()
    ready(sim, "w0", incarnation=2_000).fail()
    back = sim.worker("w0", incarnation=1_000)  # started later on a host whose clock reads earlier
    assert back.hello()
    back.boot()
    assert sim.process("w0").incarnation == 1_000 and sim.core.has_ready_target()
    assert not sim.worker("w0", incarnation=900).hello()  # while one lives, an older incarnation is stale


def test_an_incarnation_more_than_a_day_ahead_of_the_schedulers_wall_clock_is_refused() -> None:
    """The core reads no clock: the shell's wall clock is given to it, so a test sets the time a hello is judged at."""
    sim = Sim()
    day_ns = 24 * 3600 * 10**9
    assert not sim.worker("w0", incarnation=sim.wall_ns + day_ns + 1).hello()
    sim.wall_ns += 2  # the scheduler's clock catches up: the same start time is now within a day
    assert sim.worker("w0", incarnation=sim.wall_ns + day_ns).hello()


def test_a_dead_worker_comes_back_as_a_new_incarnation() -> None:
    sim = Sim()
    ready(sim, "w0").fail()
    sim.submit("a", max_tokens=1)
    back = sim.worker("w0", incarnation=7).start()
    back.run()
    assert sim.finish_reason("a") == "length"
    process = sim.process("w0")
    assert (process.incarnation, process.state, process.failure) == (7, "READY", "")


INCOMPATIBLE: dict[str, dict[str, object]] = {
    "protocol_version": {"protocol_version": m.PROTOCOL_VERSION + 1},
    "fingerprint": {"model_fingerprint": "fp-some-other-model"},
    "max_model_len": {"max_model_len": 32},
    "draft_vocabulary": {"role": "draft", "vocab_fingerprint": "vocab-of-another-tokenizer"},
}


@pytest.mark.parametrize("problem", INCOMPATIBLE)
def test_an_incompatible_hello_is_refused_with_a_drain_and_never_gets_a_step(problem: str) -> None:
    sim = Sim(max_model_len=64)
    first = sim.worker("w0")
    first.hello()  # the first target pins the model fingerprint
    refused = sim.worker("w1", identity=None, **INCOMPATIBLE[problem])
    refused.hello()
    assert refused.inbox() == [m.Drain(1)]
    process = sim.process("w1")
    assert process.state == "FAILED"
    assert process.failure.startswith("refused: ")
    assert not refused.report(State.LOADING)
    refused.state = State.WARMING
    assert not refused.report(State.READY)
    sim.submit("a", max_tokens=1)
    assert refused.all_steps() == [] and not sim.core.has_ready_target()
    first.boot()
    first.run()
    assert sim.finish_reason("a") == "length"
    assert refused.all_steps() == []


def test_a_compatible_replica_with_a_longer_context_is_accepted() -> None:
    sim = Sim(max_model_len=64)
    ready(sim, "w0")
    w1 = ready(sim, "w1", max_model_len=4096, num_kv_slots=8)
    assert w1.inbox() == []
    assert sim.process("w1").state == "READY"


# ---------------------------------------------------------------- info


def test_info_lists_every_process_with_role_state_incarnation_and_failure() -> None:
    sim = Sim()
    w0 = ready(sim, "w0", num_kv_slots=4)
    w1 = sim.worker("w1", incarnation=3, num_kv_slots=2).start(until=State.LOADING)
    sim.submit("a", max_tokens=5)
    sim.advance(1.5)
    w0.heartbeat()
    sim.advance(0.5)
    w1.fail("out of memory")
    sim.advance(2.0)
    info = sim.info()
    assert (info.model_name, info.max_model_len, info.num_waiting, info.num_running) == ("tiny-llama", 64, 0, 1)
    num_prompt = len(sim.core._requests.get("a").prompt_token_ids)  # type: ignore[union-attr]
    assert info.processes == [
        m.ProcessInfo(
            "w0",
            "target",
            "READY",
            1,
            heartbeat_age_s=2.5,
            num_used_kv_pages=1,
            num_kv_pages=4,
            kv_page_size=64,
            num_running=1,
            failure="",
            prefix_cache_queried_tokens=num_prompt,
        ),
        m.ProcessInfo(
            "w1",
            "target",
            "FAILED",
            3,
            heartbeat_age_s=2.0,
            num_used_kv_pages=0,
            num_kv_pages=2,
            kv_page_size=64,
            num_running=0,
            failure="LOADING: RuntimeError: out of memory",
        ),
    ]


def report_ready(worker: FakeWorker, kernels: str) -> bool:
    """The READY report of a worker that has warmed up, naming the kernels its model runs on."""
    worker.boot(State.WARMING)
    worker.state = State.READY
    return worker.send(
        m.LifecycleReport(worker.worker_id, worker.incarnation, State.READY, State.WARMING, 0.5, kernels=kernels)
    )


def test_info_names_the_kernels_each_incarnation_said_it_runs_on_when_ready() -> None:
    sim = Sim()
    first = sim.worker("w0")
    assert first.hello() and report_ready(first, "native (linear kernel: avx2)")
    assert sim.process("w0").kernels == "native (linear kernel: avx2)"
    first.fail()
    assert sim.process("w0").kernels == "native (linear kernel: avx2)"  # a FAILED process is listed as it was
    back = sim.worker("w0", incarnation=2).start(until=State.WARMING)
    assert sim.process("w0").kernels == ""  # a new incarnation names its kernels when READY
    assert report_ready(back, "torch (" + "x" * 2 * MAX_KERNELS_CHARS + ")")
    assert sim.process("w0").kernels == "torch (" + "x" * (MAX_KERNELS_CHARS - len("torch ("))  # cut


def test_an_info_query_is_answered_to_the_gateway_that_asked() -> None:
    sim = Sim()
    sim.submit("a")
    sim.core.on_gateway_message(b"gateway-2", m.InfoQuery(query_id=31), sim.now_s)
    (reply,) = sim.collect()
    assert reply.identity == b"gateway-2" and not reply.to_worker
    assert reply.message == sim.core.info(31, sim.now_s)
    assert (reply.message.query_id, reply.message.num_waiting) == (31, 1)


# ---------------------------------------------------------------- malformed worker messages (bugs)


def test_a_lifecycle_report_with_an_unknown_state_never_decodes() -> None:
    """States are typed on the wire: the shell drops (and counts) such a frame before the core sees it."""
    frame = msgspec.msgpack.encode(m.LifecycleReport("w0", 1, "SLEEPING", State.READY, 1.0))  # type: ignore[arg-type]
    with pytest.raises(msgspec.ValidationError, match="state"):
        m.Codec(m.WorkerToScheduler).decode(frame)
    assert m.Codec(m.WorkerToScheduler).decode(
        msgspec.msgpack.encode(m.LifecycleReport("w0", 1, State.READY, State.WARMING, 1.0))
    ) == m.LifecycleReport("w0", 1, State.READY, State.WARMING, 1.0)


def test_a_worker_reporting_an_illegal_transition_is_ignored_and_keeps_serving() -> None:
    sim = Sim()
    w0 = ready(sim, "w0")
    sim.submit("a", prompt(3), max_tokens=3)
    w0.complete({"a": [11]})
    assert not w0.send(m.LifecycleReport("w0", 1, State.DEAD, State.READY, 1.0))  # never reported by a process itself
    assert not w0.send(m.LifecycleReport("w0", 1, State.LOADING, State.READY, 1.0))  # READY -> LOADING is illegal
    assert sim.process("w0").state == "READY"
    w0.run({"a": [12, 13]})
    assert sim.streamed("a") == [11, 12, 13]


def test_a_step_result_missing_a_sampled_output_does_not_strand_the_request() -> None:
    sim = Sim()
    w0 = ready(sim, "w0")
    sim.submit("a", prompt(3), max_tokens=2)
    step = w0.step()
    w0.send(m.StepResult("w0", 1, step.step_id, outputs=[], duration_ms=1.0))  # should have held one SeqOutput
    w1 = ready(sim, "w1")
    for worker in (w0, w1, w0, w1):
        if worker.pending_step() is not None:
            worker.run()
    assert sim.finish_reason("a") == "length" or sim.errors("a")


def test_one_steps_tokens_reach_the_gateway_as_one_frame() -> None:
    sim = Sim()
    worker = ready(sim)
    for name in ("a", "b", "c"):
        sim.submit(name, prompt(3), max_tokens=4)
    worker.complete()  # the first step held only "a": the others came while it ran
    num_sent = len(sim.sent)
    worker.complete()  # the next step: "a" decodes, "b" and "c" prefill, one token each
    frames = [o.message for o in sim.sent[num_sent:] if not o.to_worker]
    assert len(frames) == 1 and isinstance(frames[0], m.TokenDeltas)
    assert sorted(d.request_id for d in frames[0].deltas) == ["a", "b", "c"]


@pytest.mark.parametrize("stuck_in", [State.STARTING, State.LOADING, State.ALLOCATING, State.WARMING])
def test_a_phase_past_its_deadline_fails_the_worker_names_the_setting_and_it_never_gets_a_step(stuck_in: State) -> None:
    sim = Sim(phase_timeout_s=30.0)
    other = ready(sim, "w1")
    stuck = sim.worker("w0", identity=None).start(until=stuck_in)
    sim.advance(20)
    other.heartbeat()
    stuck.heartbeat()  # heartbeats alone do not keep a phase alive
    sim.check_timeouts()
    assert sim.process("w0").state == stuck_in.value
    sim.advance(15)
    other.heartbeat()
    stuck.heartbeat()
    sim.check_timeouts()
    process = sim.process("w0")
    assert process.state == "FAILED" and "--phase-timeout-s" in process.failure and stuck_in.value in process.failure
    assert stuck.inbox() == [m.Drain(1)]
    sim.submit("a", max_tokens=2)
    other.run()
    assert sim.finish_reason("a") == "length"
    assert not stuck.report(State.READY if stuck_in is State.WARMING else State.LOADING)  # later reports are dropped
    assert stuck.all_steps() == []


def test_dropped_messages_are_counted_for_the_info_reply_by_process_socket_and_kind() -> None:
    sim = Sim()
    worker = ready(sim, "w0")
    assert worker.send(m.Heartbeat("w0", worker.incarnation, State.READY, 0, 0, protocol_errors={"decode": 2}))
    sim.core.protocol_errors["worker"].record("stale_or_unexpected")
    sim.core.protocol_errors["gateway"].record("decode")
    info = sim.info()
    assert info.protocol_errors == {"worker.stale_or_unexpected": 1, "gateway.decode": 1}
    assert sim.process("w0").protocol_errors == {"decode": 2}
