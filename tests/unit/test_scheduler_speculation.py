"""SchedulerCore with a draft service: propose then verify, the batch-size switch,
the draft's counts, its loss and return.

The fake draft (tests/unit/scheduler_fakes.py) checks every propose request against the
tokens it holds per sequence; the fake target verifies drafts greedily against a script
and checks every step against its KV model, cut back past rejected drafts.
"""

from __future__ import annotations

import pytest

from proto import messages as m
from proto.lifecycle import State
from scheduler.batching import ScheduledSeq
from scheduler.requests import Request
from scheduler.speculation.proposing import proposal_problem
from scheduler.speculation.policy import SpecLimits, draft_caps
from tests.unit.scheduler_fakes import EOS, FINGERPRINT, FakeDraft, FakeWorker, Sim, assert_all_free, prompt

SCRIPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]


def setup(**config: object) -> tuple[Sim, FakeWorker, FakeDraft]:
    sim = Sim(**config)
    worker = sim.worker("w0").start()
    draft = sim.draft("d0").start()
    return sim, worker, draft


def proposes(draft: FakeDraft) -> list[m.ProposeRequest]:
    draft.draft_inbox()
    return list(draft.proposes)


# ---------------------------------------------------------------- the flow


def _recorded(sim: Sim, draft: FakeDraft) -> list[tuple[str, list[int]]]:
    return [
        (item.message.tenant, item.message.token_ids)
        for item in sim.sent
        if isinstance(item.message, m.RecordText) and item.identity == draft.identity
    ]


def test_a_draft_that_learns_from_traffic_gets_each_prompt_as_it_comes_and_each_completion_as_it_ends() -> None:
    sim = Sim(num_speculative_tokens=0)  # no speculation: the draft is never asked, and learns all the same
    worker = sim.worker("w0").start()
    draft = sim.draft("d0", learns_from_traffic=True).start()
    long_prompt = list(range(100, 150))
    sim.submit("a", long_prompt, max_tokens=3, tenant="key:1")
    assert _recorded(sim, draft) == [("key:1", long_prompt)]
    worker.run({"a": [7, 8, 9]})
    assert sim.finish_reason("a") == "length"
    assert _recorded(sim, draft)[1:] == [("key:1", long_prompt[-m.COMPLETION_LEAD_IN :] + [7, 8, 9])]
    sim.submit("b", tenant="key:2")
    sim.abort("b")  # an aborted request's completion is not recorded (its prompt was)
    assert [tenant for tenant, _ in _recorded(sim, draft)] == ["key:1", "key:1", "key:2"]


def test_a_draft_that_does_not_learn_is_sent_no_text() -> None:
    sim, worker, draft = setup()
    sim.submit("a", prompt(3), max_tokens=2, tenant="key:1")
    worker.run({"a": [7, 8]})
    assert _recorded(sim, draft) == [] and sim.finish_reason("a") == "length"


@pytest.mark.parametrize("draft_script", ["right", "wrong", "half_right", "none"])
def test_greedy_output_is_the_targets_whatever_the_draft_proposes(draft_script: str) -> None:
    sim, worker, draft = setup(num_speculative_tokens=4)
    sim.submit("a", prompt(3), max_tokens=10)
    sequence = prompt(3) + SCRIPT
    draft.script["a"] = {
        "right": sequence,
        "wrong": prompt(3) + [t + 100 for t in SCRIPT],
        "half_right": prompt(3) + [t if i % 2 == 0 else 99 for i, t in enumerate(SCRIPT)],
        "none": [],
    }[draft_script]
    worker.run({"a": SCRIPT}, draft=draft)
    assert sim.streamed("a") == SCRIPT[:10]
    assert sim.finish_reason("a") == "length"
    final = sim.deltas("a")[-1]
    expected_accepted = {"right": 4 + 3, "wrong": 0, "half_right": None, "none": 0}[draft_script]
    if expected_accepted is not None:
        assert final.num_accepted_draft_tokens == expected_accepted
    assert final.num_accepted_draft_tokens <= final.num_draft_tokens
    assert draft.forgotten() == ["a"]
    assert_all_free(sim, worker)


def test_a_verify_step_carries_the_last_token_then_the_drafts_and_the_draft_gets_only_what_is_new() -> None:
    sim, worker, draft = setup(num_speculative_tokens=3)
    sim.submit("a", prompt(3), max_tokens=10)
    worker.complete({"a": [11]})  # prefill: no proposal yet
    (first,) = proposes(draft)
    assert first.seqs[0] == m.ProposeSeq("a", 0, 0, prompt(3) + [11], 3, m.SamplingParams())
    draft.answer({"a": [12, 13, 77]})
    seq = worker.step().seqs[0]
    assert (seq.start_position, seq.token_ids, seq.num_draft_tokens) == (3, [11, 12, 13, 77], 3)
    worker.complete({"a": [12, 13, 14]})  # accepts 12, 13; rejects 77 and adds 14
    second = proposes(draft)[-1].seqs[0]
    # The draft holds 4 + 3 tokens; 77 is dropped and only 14 is new.
    assert (second.num_held, second.num_drop, second.new_token_ids) == (7, 1, [14])
    draft.answer({"a": []})
    assert sim.streamed("a") == [11, 12, 13, 14]
    assert worker.tokens_of["a"] == prompt(3) + [11, 12, 13]  # the accepted branch stands, the rejected draft does not


def test_a_token_tree_reaches_the_target_and_the_draft_is_told_what_it_holds_in_place() -> None:
    sim, worker, draft = setup(num_speculative_tokens=4)
    sim.submit("a", prompt(3), max_tokens=20)
    worker.complete({"a": [11]})
    proposes(draft)
    # Two guesses at the first token; the second holds the right branch, 12 then 13.
    draft.answer({"a": [77, 12, 13, 78]}, parents={"a": [-1, -1, 1, 1]})
    seq = worker.step().seqs[0]
    assert (seq.token_ids, seq.num_draft_tokens, seq.draft_parents) == ([11, 77, 12, 13, 78], 4, [-1, -1, 1, 1])
    worker.complete({"a": [12, 13, 14]})
    assert worker.returned["a"] == [11, 12, 13, 14]
    second = proposes(draft)[-1].seqs[0]
    # The draft holds its tree in node order: the branch is not its first nodes,
    # so all four go and the branch comes new.
    assert (second.num_held, second.num_drop, second.new_token_ids) == (8, 4, [12, 13, 14])
    # A branch that is the first nodes stays where the draft holds it.
    draft.answer({"a": [15, 16, 90]}, parents={"a": [-1, 0, -1]})
    worker.complete({"a": [15, 16, 17]})
    third = proposes(draft)[-1].seqs[0]
    assert (third.num_held, third.num_drop, third.new_token_ids) == (7 + 3, 1, [17])
    draft.answer({"a": []})
    assert sim.streamed("a") == [11, 12, 13, 14, 15, 16, 17]
    assert worker.tokens_of["a"] == prompt(3) + [11, 12, 13, 14, 15, 16]


@pytest.mark.parametrize("parents", [[1, -1], [-1]])  # a parent after its child; one parent for two tokens
def test_a_malformed_token_tree_never_reaches_the_target(parents: list[int]) -> None:
    sim, worker, draft = setup(num_speculative_tokens=4)
    draft.strict = False
    sim.submit("a", prompt(3), max_tokens=20)
    worker.complete({"a": [11]})
    draft.answer({"a": [77, 12]}, parents={"a": parents})
    seq = worker.step().seqs[0]
    assert (seq.num_draft_tokens, seq.draft_parents) == (0, None)


def test_a_token_tree_of_point_masses_reaches_the_target_for_a_sampled_request_too() -> None:
    sim, worker, draft = setup(num_speculative_tokens=4)
    sim.submit("a", prompt(3), max_tokens=20, sampling=m.SamplingParams(temperature=0.7, seed=3))
    worker.complete({"a": [11]})
    draft.answer({"a": [77, 12]}, parents={"a": [-1, -1]})
    seq = worker.step().seqs[0]
    assert (seq.num_draft_tokens, seq.draft_parents, seq.draft_dists) == (2, [-1, -1], None)


def test_a_sequence_without_a_proposal_decodes_plainly_in_the_same_step() -> None:
    sim, worker, draft = setup()
    sim.submit("a", prompt(3), max_tokens=10)
    sim.submit("b", prompt(3, first=300), max_tokens=10)
    worker.complete({"a": [11]})  # a's prefill; b joins the next step
    draft.answer({"a": []})
    worker.complete({"a": [12], "b": [41]})
    assert [s.request_id for s in proposes(draft)[-1].seqs] == ["a", "b"]
    draft.answer({"a": [13, 14], "b": []})
    by_id = {s.request_id: s for s in worker.step().seqs}
    assert (by_id["a"].num_draft_tokens, by_id["b"].num_draft_tokens) == (2, 0)
    assert by_id["b"].token_ids == [41]


def test_above_the_threshold_steps_decode_plainly_and_below_it_speculation_resumes() -> None:
    sim, worker, draft = setup(spec_disable_batch_threshold=2, max_num_seqs=8)
    for rid in "abc":
        sim.submit(rid, prompt(3, first=100 + 10 * ord(rid)), max_tokens=3 if rid == "c" else 8)
    worker.run(draft=draft)
    steps = worker.all_steps()
    sizes_with_proposals = {len(s.seqs) for s in steps if any(w.num_draft_tokens for w in s.seqs)}
    asked = [len(p.seqs) for p in proposes(draft)]
    assert asked and max(asked) <= 2  # never asked for a step of 3 sequences
    assert sizes_with_proposals <= {1, 2}
    assert any(len(s.seqs) == 3 for s in steps)  # the big steps ran, plainly
    assert sim.finish_reason("a") == sim.finish_reason("c") == "length"


def test_the_draft_token_budget_is_shared_by_the_sequences_of_each_propose_request() -> None:
    sim, worker, draft = setup(spec_draft_token_budget=4, spec_disable_batch_threshold=8, max_num_seqs=8)
    for rid in "abcd":
        sim.submit(rid, prompt(3, first=100 + 10 * ord(rid)), max_tokens=8)
    worker.run(draft=draft)
    asked = [(len(p.seqs), max(s.num_tokens for s in p.seqs)) for p in proposes(draft)]
    assert (4, 1) in asked  # four decoding sequences: one draft token each
    assert all(k <= 4 // n for n, k in asked)
    assert all(sim.finish_reason(rid) == "length" for rid in "abcd")


def test_threshold_zero_or_k_zero_never_proposes() -> None:
    for config in ({"spec_disable_batch_threshold": 0}, {"num_speculative_tokens": 0}):
        sim, worker, draft = setup(**config)
        sim.submit("a", max_tokens=6)
        worker.run(draft=draft)
        assert proposes(draft) == []
        assert len(sim.streamed("a")) == 6


def test_k_never_runs_past_max_tokens() -> None:
    sim, worker, draft = setup(num_speculative_tokens=8)
    sim.submit("a", prompt(3), max_tokens=4)
    draft.script["a"] = prompt(3) + SCRIPT
    worker.run({"a": SCRIPT}, draft=draft)
    assert [s.num_tokens for p in proposes(draft) for s in p.seqs] == [2]  # 1 streamed, room for 3 more: k = 2
    assert sim.streamed("a") == SCRIPT[:4]


def test_a_stop_token_among_accepted_drafts_ends_the_request_there() -> None:
    sim, worker, draft = setup()
    sim.submit("a", prompt(3), max_tokens=10)
    script = [11, 12, EOS, 14, 15]
    draft.script["a"] = prompt(3) + script
    worker.run({"a": script}, draft=draft)
    assert sim.streamed("a") == [11, 12, EOS]
    assert sim.finish_reason("a") == "stop"


# ---------------------------------------------------------------- the draft going away


def test_no_draft_service_means_plain_decoding() -> None:
    sim = Sim()
    worker = sim.worker("w0").start()
    sim.submit("a", max_tokens=5)
    worker.run()
    assert all(s.num_draft_tokens == 0 for step in worker.all_steps() for s in step.seqs)
    assert sim.deltas("a")[-1].num_draft_tokens == 0


@pytest.mark.parametrize("ready_limit", [0, 2])
def test_a_target_that_lowers_its_draft_limit_at_ready_gets_no_more_drafts_than_that(ready_limit: int) -> None:
    """0: the worker found its steps not batch invariant on warming up, so it decodes plainly."""
    sim = Sim(num_speculative_tokens=4)
    worker = sim.worker("w0")
    assert worker.hello()
    worker.boot(State.WARMING)
    assert worker.send(
        m.LifecycleReport("w0", worker.incarnation, State.READY, State.WARMING, 0.5, max_draft_tokens=ready_limit)
    )
    worker.state = State.READY
    draft = sim.draft("d0").start()
    sim.submit("a", prompt(3), max_tokens=10)
    draft.script["a"] = prompt(3) + SCRIPT
    worker.run({"a": SCRIPT}, draft=draft)
    assert sim.streamed("a") == SCRIPT[:10]
    drafts = [s.num_draft_tokens for step in worker.all_steps() for s in step.seqs]
    assert max(drafts) == ready_limit
    assert (proposes(draft) == []) == (ready_limit == 0)


def test_a_draft_lost_while_proposing_lets_the_step_run_plainly_and_a_new_incarnation_starts_from_nothing() -> None:
    sim, worker, draft = setup()
    sim.submit("a", prompt(3), max_tokens=12)
    draft.script["a"] = prompt(3) + SCRIPT
    worker.complete({"a": [11]})
    draft.answer()
    worker.complete({"a": SCRIPT[1:6]})  # 4 drafts accepted, one more
    assert proposes(draft)[-1] and worker.pending_step() is None  # waiting for the draft
    draft.fail("draft model crashed")
    step = worker.step()  # sent at once, without proposals
    assert step.seqs[0].num_draft_tokens == 0
    worker.complete({"a": [SCRIPT[6]]})  # the next step goes out plainly too: no draft is READY
    back = sim.draft("d0", incarnation=2).start()
    back.script["a"] = prompt(3) + SCRIPT
    worker.run({"a": SCRIPT[7:]}, draft=back)
    first = proposes(back)[0].seqs[0]
    assert (first.num_held, first.num_drop, first.new_token_ids) == (0, 0, prompt(3) + SCRIPT[:8])
    assert sim.streamed("a") == SCRIPT[:12]
    assert sim.finish_reason("a") == "length"


def test_an_unanswered_proposal_times_out_and_the_step_runs_plainly() -> None:
    sim, worker, draft = setup(propose_timeout_s=0.5)
    sim.submit("a", prompt(3), max_tokens=5)
    worker.complete({"a": [11]})
    assert draft.pending_propose() is not None and worker.pending_step() is None
    sim.advance(0.4)
    sim.check_timeouts()
    assert worker.pending_step() is None
    sim.advance(0.2)
    sim.check_timeouts()
    assert worker.step().seqs[0].num_draft_tokens == 0
    draft.answer({"a": [12]})  # too late: only the draft's counts are taken from it
    worker.complete({"a": [12]})
    nxt = proposes(draft)[-1].seqs[0]
    assert (nxt.num_held, nxt.num_drop) == (5, 1)  # it holds 4 + its late proposal; that goes
    draft.answer({"a": [13]})
    worker.run({"a": [13, 14, 15]}, draft=draft)
    assert sim.streamed("a") == [11, 12, 13, 14, 15]


def test_tokens_reach_the_gateway_once_the_step_waiting_for_proposals_is_sent() -> None:
    """While a target waits for the draft's answer, the gateway is not woken to stream: it would take the core the
    round trip needs. The tokens go with the step, or at the propose timeout."""
    sim, worker, draft = setup(propose_timeout_s=0.5)
    sim.submit("a", prompt(3), max_tokens=10)
    worker.complete({"a": [11]})
    assert draft.pending_propose() is not None
    assert sim.streamed("a") == []
    draft.answer({"a": [12, 13]})
    assert worker.step().seqs[0].num_draft_tokens == 2
    assert sim.streamed("a") == [11]
    worker.complete({"a": [12, 13, 14]})
    assert sim.streamed("a") == [11]  # waiting again, for the next proposal
    sim.advance(0.6)
    sim.check_timeouts()
    assert worker.step().seqs[0].num_draft_tokens == 0
    assert sim.streamed("a") == [11, 12, 13, 14]


def test_tokens_of_a_step_without_proposals_go_out_at_once() -> None:
    sim, worker, _ = setup(num_speculative_tokens=0)
    sim.submit("a", prompt(3), max_tokens=5)
    worker.complete({"a": [11]})
    assert worker.step().seqs[0].num_draft_tokens == 0
    assert sim.streamed("a") == [11]


def test_a_draft_that_refuses_a_proposal_while_draining_is_not_failed_and_the_step_runs_plainly() -> None:
    sim, worker, draft = setup(num_speculative_tokens=3)
    sim.submit("a", prompt(3), max_tokens=4)
    worker.complete({"a": [11]})
    request = draft.pending_propose()
    assert request is not None
    draft.report(State.DRAINING)  # SIGTERM: it takes no new work
    assert draft.send(m.ProposeRefused("d0", draft.incarnation, request.propose_id, State.DRAINING, "not READY"))
    assert sim.process("d0").state == "DRAINING" and sim.process("d0").failure == ""
    assert worker.step().seqs[0].num_draft_tokens == 0
    worker.run({"a": [12, 13, 14]})
    assert sim.streamed("a") == [11, 12, 13, 14]
    assert draft.report(State.STOPPED) and sim.process("d0").state == "STOPPED"


def test_a_bad_proposal_never_reaches_the_target() -> None:
    sim, worker, draft = setup(num_speculative_tokens=2)
    draft.strict = False
    sim.submit("a", prompt(3), max_tokens=8)
    worker.complete({"a": [11]})
    draft.answer({"a": [12, 13, 14]})  # three tokens where two were asked for
    assert worker.step().seqs[0].num_draft_tokens == 0
    worker.complete({"a": [12]})
    again = proposes(draft)[-1].seqs[0]
    assert (again.num_held, again.num_drop) == (0, 0)  # counts reset: the draft starts the sequence over
    draft.answer()
    assert draft.restarts == ["a"]
    worker.complete({"a": [13]})
    draft.answer({"a": [49152]})  # outside the target's vocabulary
    assert worker.step().seqs[0].num_draft_tokens == 0


def test_a_draft_with_another_vocabulary_is_refused_whichever_comes_first() -> None:
    sim = Sim()
    sim.worker("w0").start()
    late = sim.draft("d0", vocab_fingerprint="other-tokenizer", vocab_size=32000)
    late.hello()
    assert "vocabulary" in sim.process("d0").failure and sim.process("d0").state == "FAILED"
    assert late.draft_inbox() == [m.Drain(1)]

    sim = Sim()
    early = sim.draft("d0", vocab_fingerprint="other-tokenizer", vocab_size=32000).start()
    assert sim.process("d0").state == "READY"  # nothing to compare with yet
    sim.worker("w0").start()
    assert sim.process("d0").state == "FAILED" and "vocabulary" in sim.process("d0").failure
    assert early.draft_inbox() == [m.Drain(1)]


def test_a_draft_with_the_same_vocabulary_or_none_is_accepted() -> None:
    sim = Sim()
    sim.worker("w0").start()
    sim.draft("d0").start()  # n-gram: works on any vocabulary
    sim.draft("d1", vocab_fingerprint="vocab-smol", vocab_size=49152).start()
    assert [p.state for p in sim.info().processes] == ["READY", "READY", "READY"]


def test_requests_are_never_placed_on_the_draft_service() -> None:
    sim = Sim()
    draft = sim.draft("d0").start()
    sim.submit("a", max_tokens=2)
    assert sim.core.num_waiting == 1 and proposes(draft) == []


# ---------------------------------------------------------------- stats


def test_per_request_and_server_wide_stats() -> None:
    sim, worker, draft = setup(num_speculative_tokens=4)
    sim.submit("a", prompt(3), max_tokens=10)
    draft.script["a"] = prompt(3) + SCRIPT[:3] + [99] * 20
    worker.run({"a": SCRIPT}, draft=draft)
    final = sim.deltas("a")[-1]
    # 11 comes from the prefill; then [12, 13, 99, 99] verified: 2 accepted, 14 added; then the draft is off its script.
    assert (final.num_draft_tokens, final.num_accepted_draft_tokens, final.num_verify_steps) == (4, 2, 1)
    spec = sim.info().speculation
    assert spec is not None
    assert spec.num_draft_tokens == final.num_draft_tokens
    assert spec.num_accepted_draft_tokens == final.num_accepted_draft_tokens
    assert spec.num_verify_steps == final.num_verify_steps
    assert spec.acceptance_rate == pytest.approx(final.num_accepted_draft_tokens / final.num_draft_tokens)
    # By position: drafts at 0-3, the first two accepted.
    assert spec.proposed_by_position == {0: 1, 1: 1, 2: 1, 3: 1} and spec.accepted_by_position == {0: 1, 1: 1}


def test_what_a_proposal_costs_is_averaged_over_its_answers() -> None:
    from scheduler.speculation.counters import SpecCounters

    counters = SpecCounters()
    counters.proposed(4.0, 6.0)  # the first answer counts in full
    assert (counters.propose_ms, counters.propose_wait_ms) == (4.0, 6.0)
    counters.proposed(8.0, 10.0)
    assert (counters.propose_ms, counters.propose_wait_ms) == (6.0, 8.0)
    for _ in range(200):
        counters.proposed(2.0, 3.0)
    assert counters.propose_ms == pytest.approx(2.0, abs=1e-3) and counters.propose_wait_ms == pytest.approx(
        3.0, abs=1e-3
    )
    counters.proposed(float("nan"), 1.0)  # a clock that cannot be believed
    assert counters.num_proposals == 202
    spec = counters.info()
    assert (spec.propose_ms, spec.propose_wait_ms) == (2.0, 3.0)


def test_an_ask_is_priced_at_what_it_kept_the_target_idle_beyond_a_plain_step() -> None:
    """Steps of 10 ms. A plain step's result comes 0.2 ms after its own time (the scheduler, the sockets); a step that
    waited for proposals was sent 1 ms after it was planned (the round trip) and its result comes 1 ms later than a
    plain one's would (the events on either side of the round trip, a gateway that ran meanwhile). The round trip says
    1 ms; what the target lost, and what the policy prices an ask at, is 2 ms."""
    sim = Sim(speculation_policy="fixed", num_speculative_tokens=4)
    worker = sim.worker()
    worker.step_ms = lambda step: 10.0
    worker.start()
    draft = sim.draft("d0").start()
    sim.submit("a", prompt(3), max_tokens=60)
    sim.advance(0.0102)
    worker.complete({"a": [7]})  # the prefill: a plain step
    for _ in range(10):
        asked = draft.pending_propose()
        assert asked is not None
        sim.advance(0.001)
        draft.answer({"a": [8] * asked.seqs[0].num_tokens})
        sim.advance(0.0112)
        worker.complete({"a": [8]})
    counters = sim.core._drafts.counters
    assert counters.idle_ms == pytest.approx(0.2)
    assert counters.propose_wait_ms == pytest.approx(1.0)
    assert counters.ask_ms == pytest.approx(2.0)
    assert counters.propose_cost.predict_ms(4, 1) == pytest.approx(2.0, abs=0.01)
    assert sim.info().speculation is not None and sim.info().speculation.ask_ms == pytest.approx(2.0)
    # Plain steps whose events took longer (prefills) do not make an ask look cheaper than its wait.
    counters.idle_ms = 5.0
    for _ in range(100):
        counters.stepped(4.0, (4, 1), 1.0)
    assert counters.propose_cost.predict_ms(4, 1) == pytest.approx(1.0, abs=0.05)


def test_a_trees_positions_are_its_depths() -> None:
    from scheduler.speculation.counters import SpecCounters

    counters = SpecCounters()
    counters.record(5, 2, depth=3)  # five nodes three deep, a branch of two accepted
    counters.record(2, 0)  # a chain of two, none accepted
    assert counters.proposed_by_position == {0: 2, 1: 2, 2: 1} and counters.accepted_by_position == {0: 1, 1: 1}


# ---------------------------------------------------------------- pure policy


def request(rid: str, num_output: int, max_tokens: int = 100, num_prompt: int = 5) -> Request:
    r = Request(rid, b"g", list(range(num_prompt)), max_tokens, m.SamplingParams(), frozenset(), 0.0)
    r.output_token_ids = [1] * num_output
    r.num_computed_tokens = r.num_tokens - 1
    return r


LIMITS = SpecLimits(
    num_speculative_tokens=4,
    spec_disable_batch_threshold=4,
    spec_draft_token_budget=32,
    max_num_batched_tokens=64,
    max_model_len=64,
)


def test_policy_speculates_only_up_to_the_threshold() -> None:
    plan = [ScheduledSeq(request(f"r{i}", 1), 1) for i in range(5)]
    assert draft_caps(plan[:4], LIMITS) == {f"r{i}": 4 for i in range(4)}
    assert draft_caps(plan, LIMITS) == {}


def test_policy_shares_the_draft_token_budget_evenly_and_decodes_plainly_when_it_gives_less_than_one() -> None:
    plan = [ScheduledSeq(request(f"r{i}", 1), 1) for i in range(16)]
    wide = SpecLimits(6, 16, spec_draft_token_budget=32, max_num_batched_tokens=512, max_model_len=64)
    assert draft_caps(plan[:5], wide) == {f"r{i}": 6 for i in range(5)}  # 32 // 5 = 6: k itself
    assert draft_caps(plan[:8], wide) == {f"r{i}": 4 for i in range(8)}
    assert draft_caps(plan, wide) == {f"r{i}": 2 for i in range(16)}
    scarce = SpecLimits(6, 16, spec_draft_token_budget=12, max_num_batched_tokens=512, max_model_len=64)
    assert draft_caps(plan[:12], scarce) == {f"r{i}": 1 for i in range(12)}
    assert draft_caps(plan[:13], scarce) == {}  # 12 // 13 = 0 each


def test_policy_leaves_prefill_chunks_alone_and_respects_budget_and_context() -> None:
    prefill = request("p", 0)
    prefill.num_computed_tokens = 0
    plan = [ScheduledSeq(request("a", 1), 1), ScheduledSeq(prefill, 5)]
    tight = SpecLimits(4, 4, 32, max_num_batched_tokens=8, max_model_len=64)
    assert draft_caps(plan, tight) == {"a": 2}  # 8 - 6 tokens planned
    near_end = request("z", 55, num_prompt=6)  # 61 of 64 tokens
    assert draft_caps([ScheduledSeq(near_end, 1)], LIMITS) == {"z": 2}


def test_proposal_problems_are_named() -> None:
    good = m.Proposal("a", 3, [5, 6], [m.SparseDist([5, 9], [0.5, 0.5]), m.SparseDist([6], [1.0])])
    assert proposal_problem(good, 2, 100, 3) == ""
    assert "asked for" in proposal_problem(good, 1, 100, 3)
    assert "num_held" in proposal_problem(good, 2, 100, 2)  # it cannot hold more than the sequence has
    assert "num_held" in proposal_problem(m.Proposal("a", -1, []), 2, 100, 3)
    assert "vocabulary" in proposal_problem(m.Proposal("a", 3, [500]), 2, 100, 3)
    assert "cover" in proposal_problem(m.Proposal("a", 3, [5], [m.SparseDist([9], [1.0])]), 2, 100, 3)
    assert "probability" in proposal_problem(m.Proposal("a", 3, [5], [m.SparseDist([5], [1.5])]), 2, 100, 3)
    assert "sum to 1" in proposal_problem(m.Proposal("a", 3, [5], [m.SparseDist([5, 6], [0.5, 0.1])]), 2, 100, 3)
    assert "repeats" in proposal_problem(m.Proposal("a", 3, [5], [m.SparseDist([5, 5], [0.5, 0.5])]), 2, 100, 3)
    assert "point masses" in proposal_problem(m.Proposal("a", 3, [5], [m.SparseDist([5], [1.0])], [-1]), 2, 100, 3)
    assert "parents" in proposal_problem(m.Proposal("a", 3, [5, 6], parents=[-1]), 2, 100, 3)
    assert "parent" in proposal_problem(m.Proposal("a", 3, [5, 6], parents=[0, -1]), 2, 100, 3)
    assert proposal_problem(m.Proposal("a", 3, [5, 6], parents=[-1, -1]), 2, 100, 3) == ""
    assert proposal_problem(m.Proposal("a", 3, [5, 6], chances=[1.0, 0.0]), 2, 100, 3) == ""
    assert "2 draft tokens" in proposal_problem(m.Proposal("a", 3, [5, 6], chances=[0.5]), 2, 100, 3)
    for chance in (1.5, -0.1, float("nan")):
        assert "chance" in proposal_problem(m.Proposal("a", 3, [5], chances=[chance]), 2, 100, 3)


def test_a_draft_lost_while_a_verify_step_runs_leaves_consistent_counts_for_the_next_one() -> None:
    sim, worker, draft = setup()
    sim.submit("a", prompt(3), max_tokens=20)
    draft.script["a"] = prompt(3) + SCRIPT
    worker.complete({"a": [11]})
    draft.answer()
    assert worker.step().seqs[0].num_draft_tokens > 0  # the verify step is in flight
    draft.report(State.DRAINING)
    draft.report(State.STOPPED)  # a graceful restart of the draft service
    worker.complete({"a": SCRIPT[1:8]})  # its result comes back after the draft is gone
    back = sim.draft("d0", incarnation=2).start()  # strict: fails the test if the counts disagree
    back.script["a"] = prompt(3) + SCRIPT
    worker.run({"a": SCRIPT[len(sim.streamed("a")) :]}, draft=back)
    assert proposes(back)[0].seqs[0].num_held == 0
    assert sim.streamed("a") == SCRIPT + [7] * 8 and sim.finish_reason("a") == "length"


def test_losing_a_draft_that_is_not_in_use_changes_nothing() -> None:
    sim, worker, draft = setup()
    spare = sim.draft("d1").start()
    sim.submit("a", prompt(3), max_tokens=12)
    draft.script["a"] = prompt(3) + SCRIPT
    worker.complete({"a": [11]})
    draft.answer()
    worker.complete({"a": SCRIPT[1:6]})
    spare.fail("spare crashed")
    worker.run({"a": SCRIPT[len(worker.returned["a"]) :]}, draft=draft)  # strict: the in-use draft's counts were kept
    assert proposes(spare) == [] and sim.streamed("a") == SCRIPT[:12]


# ---------------------------------------------------------------- a draft that reads target features


@pytest.mark.parametrize("draft_script", ["right", "wrong", "half_right"])
def test_a_feature_reading_draft_gets_every_target_feature_once_in_order(draft_script: str) -> None:
    sim = Sim(num_speculative_tokens=3, max_num_batched_tokens=4)  # prompts arrive in chunks
    worker = sim.worker("w0").start()
    draft = sim.draft("d0", feature_width=2, target_fingerprint=FINGERPRINT).start()
    sim.submit("a", prompt(7), max_tokens=10)
    sim.submit("b", prompt(5, first=300), max_tokens=8)
    for rid, p in (("a", prompt(7)), ("b", prompt(5, first=300))):
        draft.script[rid] = {
            "right": p + SCRIPT,
            "wrong": p + [t + 100 for t in SCRIPT],
            "half_right": p + [t if i % 2 else 99 for i, t in enumerate(SCRIPT)],
        }[draft_script]
    worker.run({"a": SCRIPT, "b": SCRIPT}, draft=draft)  # the fake draft checks every feature row it is sent
    assert sim.streamed("a") == SCRIPT[:10] and sim.streamed("b") == SCRIPT[:8]
    assert all(step.return_features for step in worker.all_steps())
    assert draft.restarts == [] and sum(len(p.seqs) for p in draft.proposes) > 4
    assert_all_free(sim, worker)


def test_steps_return_features_only_while_a_draft_reads_them() -> None:
    sim, worker, draft = setup()
    sim.submit("a", prompt(3), max_tokens=4)
    worker.run({"a": SCRIPT}, draft=draft)
    assert not any(step.return_features for step in worker.all_steps())
    assert all(seq.features is None for p in draft.proposes for seq in p.seqs)


def test_a_request_without_every_feature_decodes_plainly_while_others_speculate() -> None:
    sim = Sim(num_speculative_tokens=3)
    worker = sim.worker("w0").start()
    sim.submit("old", prompt(3), max_tokens=10)
    worker.complete({"old": [11]})  # prefill before any draft: no features come back
    draft = sim.draft("d0", feature_width=2).start()
    worker.complete({"old": [12]})  # the draft is READY now, but "old" lacks the features of its prompt
    sim.submit("new", prompt(3, first=300), max_tokens=10)
    worker.run({"old": SCRIPT, "new": SCRIPT}, draft=draft)
    proposed_for = {seq.request_id for p in draft.proposes for seq in p.seqs}
    assert proposed_for == {"new"}
    assert sim.streamed("old") == [11, 12] + SCRIPT[:8]
    assert_all_free(sim, worker)


def test_a_draft_trained_for_another_target_or_width_is_refused_whichever_comes_first() -> None:
    for draft_first in (True, False):
        for overrides, reason in (
            ({"target_fingerprint": "fp-other"}, "another target model"),
            ({"feature_width": 3}, "width 3"),
        ):
            sim = Sim()
            if draft_first:
                draft = sim.draft("d0", **overrides).start()
                sim.worker("w0").start()
            else:
                sim.worker("w0").start()
                draft = sim.draft("d0", **overrides)
                draft.hello()
            assert reason in sim.process("d0").failure, (draft_first, overrides)
            assert [d.incarnation for d in draft.draft_inbox() if isinstance(d, m.Drain)] == [1]


def test_features_keep_coming_while_a_draft_head_restarts_so_its_requests_speculate_again() -> None:
    sim = Sim(num_speculative_tokens=2)
    worker = sim.worker("w0").start()
    draft = sim.draft("d0", feature_width=2).start()
    sim.submit("a", prompt(3), max_tokens=12)
    worker.complete({"a": [11]})
    draft.answer({"a": []})
    worker.complete({"a": [12]})
    draft.fail()  # the pending proposal is given up; the step runs plainly
    worker.complete({"a": [13]})
    worker.complete({"a": [14]})
    assert all(step.return_features for step in worker.all_steps())
    again = sim.draft("d0", incarnation=2, feature_width=2).start()
    again.script["a"] = prompt(3) + SCRIPT
    worker.run({"a": SCRIPT[4:]}, draft=again)  # the fake draft checks it gets every row from position 0
    assert any(seq.request_id == "a" for p in again.proposes for seq in p.seqs)
    assert sim.streamed("a") == SCRIPT[:12]
    assert_all_free(sim, worker)


def test_the_speculation_flags_default_to_16_sequences_and_32_draft_tokens_and_refuse_negatives() -> None:
    import argparse

    from scheduler.config import add_arguments, from_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = from_arguments(parser.parse_args(["--insecure-loopback"]))
    # k and the threshold unless given come from the draft's kind (speculation_caps); the budget is the scheduler's.
    assert (config.num_speculative_tokens, config.spec_disable_batch_threshold, config.spec_draft_token_budget) == (
        None,
        None,
        32,
    )
    with pytest.raises(ValueError, match="--spec-draft-token-budget must be at least 0"):
        from_arguments(parser.parse_args(["--spec-draft-token-budget", "-1", "--insecure-loopback"]))
