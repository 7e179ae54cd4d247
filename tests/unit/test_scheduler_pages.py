"""The scheduler's KV pages through its public interface: the prefix cache, admission, preemption by recompute,
prompts no cache can hold, and cache-aware placement.

The fake worker records the token each page position holds, so a step that reads a
cached prefix is checked against what was really written there (`tokens_of`).
"""

from __future__ import annotations

import pytest

from tests.unit.scheduler_fakes import EOS, FakeWorker, Sim, assert_all_free, prompt
from tests.unit.test_scheduler_core import assert_stream, steps_to

PAGE = 4  # positions per page in these tests


def paged(sim: Sim, worker_id: str = "w0", num_pages: int = 32) -> FakeWorker:
    return sim.worker(worker_id, num_kv_pages=num_pages, kv_page_size=PAGE).start()


def scripted(n: int, first: int = 500) -> list[int]:
    return list(range(first, first + n))


def test_a_repeated_prompt_reads_its_cached_full_pages_and_computes_only_the_rest() -> None:
    sim = Sim()
    worker = paged(sim)
    sim.submit("a", prompt(10), max_tokens=3)
    worker.run({"a": scripted(3)})
    sim.submit("b", prompt(10), max_tokens=3)
    first = worker.seqs_of("b")[0]
    # Two full pages (tokens 0..7) are cached; the last page, holding the last prompt token, is computed.
    assert (first.start_position, first.token_ids) == (8, prompt(10)[8:])
    assert first.pages[:2] == worker.seqs_of("a")[0].pages[:2]
    worker.run({"b": scripted(3)})
    assert worker.tokens_of["b"][:10] == prompt(10)  # what b read from a's pages is its own prompt
    assert_stream(sim, "b", scripted(3), "length", num_prompt_tokens=10)
    assert [d.num_cached_tokens for d in sim.deltas("b")] == [8] * len(sim.deltas("b"))
    assert all(d.num_cached_tokens == 0 for d in sim.deltas("a"))
    target = sim.process("w0")
    assert (target.prefix_cache_queried_tokens, target.prefix_cache_hit_tokens) == (20, 8)
    assert_all_free(sim, worker)


def test_the_generated_tokens_pages_are_cached_too_so_a_next_turn_reuses_them() -> None:
    sim = Sim()
    worker = paged(sim)
    sim.submit("turn-1", prompt(5), max_tokens=7)
    worker.run({"turn-1": scripted(7)})
    conversation = prompt(5) + scripted(7) + [900, 901, 902]
    sim.submit("turn-2", conversation, max_tokens=2)
    # Turn 1 computed 11 tokens (its last token was sampled, never fed back): 2 full pages, the second one
    # holding 3 tokens of the prompt and 1 of the answer.
    assert worker.seqs_of("turn-2")[0].start_position == 8
    worker.run({"turn-2": [7, 8]})
    assert worker.tokens_of["turn-2"][:15] == conversation


def test_without_the_prefix_cache_every_prompt_is_computed_from_its_start() -> None:
    sim = Sim(prefix_cache=False)
    worker = paged(sim)
    for request_id in ("a", "b"):
        sim.submit(request_id, prompt(10), max_tokens=2)
        worker.run()
        assert worker.seqs_of(request_id)[0].start_position == 0
    assert sim.process("w0").prefix_cache_hit_tokens == 0
    assert sim.process("w0").num_used_kv_pages == 0  # nothing is kept once the requests end


def test_admission_is_by_pages_not_by_requests() -> None:
    sim = Sim()
    worker = paged(sim, num_pages=8)  # 32 positions
    sim.submit("long", prompt(20, first=100), max_tokens=2)  # 5 pages, then room to grow
    sim.submit("short", prompt(3, first=200), max_tokens=1)  # 1 page
    sim.submit("waits", prompt(12, first=300), max_tokens=1)  # 3 pages: 2 are free
    assert (sim.core.num_running, sim.core.num_waiting) == (2, 1)
    worker.run()
    assert [sim.finish_reason(r) for r in ("long", "short", "waits")] == ["length"] * 3
    assert_all_free(sim, worker)


def test_when_pages_run_out_the_latest_request_is_preempted_and_recomputed_without_losing_or_repeating_a_token() -> (
    None
):
    sim = Sim()
    worker = paged(sim, num_pages=6)  # 24 positions for two requests that grow to 14 each
    sim.submit("first", prompt(6, first=100), max_tokens=8)
    sim.submit("second", prompt(6, first=200), max_tokens=8)
    assert sim.core.num_running == 2
    worker.run({"first": scripted(8, 600), "second": scripted(8, 700)})
    assert sim.process("w0").num_preemptions >= 1
    assert_stream(sim, "first", scripted(8, 600), "length", num_prompt_tokens=6)
    assert_stream(sim, "second", scripted(8, 700), "length", num_prompt_tokens=6)
    # The preempted one was recomputed from its own tokens: prompt, then what it had streamed.
    assert worker.tokens_of["second"] == prompt(6, first=200) + scripted(7, 700)
    assert_all_free(sim, worker)


def test_preemption_takes_the_most_recently_placed_request() -> None:
    sim = Sim()
    worker = paged(sim, num_pages=5)
    sim.submit("old", prompt(7, first=100), max_tokens=8)  # 2 pages
    sim.submit("new", prompt(7, first=200), max_tokens=8)  # 2 pages: 1 free
    worker.complete()  # both prefilled
    for _ in range(6):
        if sim.process("w0").num_preemptions:
            break
        worker.complete()
    assert sim.process("w0").num_preemptions == 1
    assert sim.core.num_waiting == 1 and steps_to(worker)[-1] == ["old"]


def test_by_priority_the_queue_places_lower_values_first_then_in_the_order_they_came() -> None:
    sim = Sim(scheduling_policy="priority", max_num_seqs=1)
    worker = paged(sim)
    sim.submit("running", prompt(3, first=100), max_tokens=2)  # placed at once: the worker was free
    sim.submit("later", prompt(3, first=200), max_tokens=2, priority=5)
    sim.submit("urgent", prompt(3, first=300), max_tokens=2, priority=-1)
    sim.submit("default", prompt(3, first=400), max_tokens=2)
    sim.submit("later-too", prompt(3, first=500), max_tokens=2, priority=5)
    worker.run()
    order = list(dict.fromkeys(request_id for step in steps_to(worker) for request_id in step))
    assert order == ["running", "urgent", "default", "later", "later-too"]  # by priority, then as they came


def test_by_priority_a_worker_out_of_pages_preempts_the_lowest_priority_not_the_latest() -> None:
    sim = Sim(scheduling_policy="priority")
    worker = paged(sim, num_pages=5)
    sim.submit("low", prompt(7, first=100), max_tokens=8, priority=3)  # 2 pages
    sim.submit("high", prompt(7, first=200), max_tokens=8, priority=-3)  # 2 pages: 1 free; placed last
    worker.complete()
    for _ in range(6):
        if sim.process("w0").num_preemptions:
            break
        worker.complete()
    assert sim.process("w0").num_preemptions == 1
    assert sim.core.num_waiting == 1 and steps_to(worker)[-1] == ["high"]  # fcfs would have preempted "high"
    worker.run()
    assert [sim.finish_reason(r) for r in ("low", "high")] == ["length", "length"]
    assert_all_free(sim, worker)


def test_first_come_first_served_refuses_a_priority_and_every_policy_a_priority_past_int32() -> None:
    sim = Sim()
    sim.submit("asks", prompt(3), priority=2)
    (error,) = sim.errors("asks")
    assert error.code == "INVALID_ARGUMENT" and "--scheduling-policy fcfs" in error.message
    assert sim.core.num_waiting == 0  # nothing changed
    by_priority = Sim(scheduling_policy="priority")
    by_priority.submit("huge", prompt(3), priority=2**31)
    assert "priority must be in" in by_priority.errors("huge")[0].message


def test_a_proposal_that_does_not_fit_is_dropped_before_anyone_is_preempted() -> None:
    sim = Sim(num_speculative_tokens=4)
    worker = paged(sim, num_pages=3)  # 12 positions
    draft = sim.draft("d0").start()
    sim.submit("a", prompt(6), max_tokens=6)
    worker.complete({"a": [11]})  # prefill: 7 tokens, 2 pages
    draft.answer({"a": [12, 13, 14, 15]})  # 4 drafts would need positions 7..11: a third page, then a fourth
    seq = worker.step().seqs[0]
    assert seq.num_draft_tokens == 4 and len(seq.pages) == 3
    worker.run({"a": [12, 13, 14, 15, 16, 17]}, draft=draft)
    assert sim.process("w0").num_preemptions == 0
    assert sim.streamed("a")[:6] == [11, 12, 13, 14, 15, 16]


def test_a_prompt_no_cache_can_hold_is_refused_naming_the_limit_and_the_server_serves_on() -> None:
    sim = Sim()
    worker = paged(sim, num_pages=4)  # 16 positions
    sim.submit("huge", prompt(20), max_tokens=1)
    (error,) = sim.errors("huge")
    assert error.code == "INVALID_ARGUMENT"
    assert "20 tokens" in error.message and "4 pages" in error.message and "--kv-cache-memory" in error.message
    sim.submit("fits", prompt(5), max_tokens=2)
    worker.run()
    assert sim.finish_reason("fits") == "length"
    assert_all_free(sim, worker)


def test_a_prompt_waiting_for_a_worker_is_refused_once_one_says_its_cache_is_too_small() -> None:
    sim = Sim()
    sim.submit("huge", prompt(20), max_tokens=1)
    assert sim.errors("huge") == []
    paged(sim, num_pages=4)
    assert sim.errors("huge")[0].code == "INVALID_ARGUMENT"


def test_a_sequence_that_alone_outgrows_the_cache_finishes_with_length() -> None:
    sim = Sim()
    worker = paged(sim, num_pages=4)
    sim.submit("a", prompt(10), max_tokens=20, stop_token_ids=[EOS])
    worker.run()
    assert sim.finish_reason("a") == "length"
    assert len(prompt(10)) + len(sim.streamed("a")) == 4 * PAGE + 1  # every position filled, then one more token
    assert_all_free(sim, worker)


@pytest.mark.parametrize(("num_busy", "expected"), [(0, "w0"), (4, "w0"), (5, "w1")])
def test_a_request_goes_to_the_worker_holding_its_prefix_unless_that_one_is_much_busier(
    num_busy: int, expected: str
) -> None:
    """Much busier: more than twice the least busy worker's running sequences plus four."""
    sim = Sim(max_num_seqs=16)
    w0 = paged(sim, "w0", num_pages=64)
    sim.submit("first", prompt(12), max_tokens=1)
    w0.run()
    for i in range(num_busy):
        sim.submit(f"busy-{i}", prompt(3, first=300 + 10 * i), max_tokens=50)
    w1 = paged(sim, "w1", num_pages=64)  # idle, and holds nothing
    sim.submit("again", prompt(12), max_tokens=1)
    holder = sim.process(expected)
    assert holder.num_running == (num_busy + 1 if expected == "w0" else 1)
    assert holder.prefix_cache_hit_tokens == (8 if expected == "w0" else 0)  # w0's hit counts "again"'s 8 only
    w0.run()
    w1.run()
    assert sim.finish_reason("again") == "length"


def test_without_a_cached_prefix_the_least_busy_worker_gets_the_request() -> None:
    sim = Sim(max_num_seqs=16)
    w0 = paged(sim, "w0")
    sim.submit("busy", prompt(3), max_tokens=50)
    w1 = paged(sim, "w1")
    sim.submit("new", prompt(12, first=400), max_tokens=1)
    assert w1.seqs_of("new") and not w0.seqs_of("new")
