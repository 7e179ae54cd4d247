"""Log-probabilities and penalties through SchedulerCore.

Log-probabilities are asked of the worker only where they are owed, streamed with the
tokens they belong to (cut where the tokens are), a prompt's once each however often it is
computed. A request with penalties sends the worker, in every sampling step, the tokens
its penalties count.
"""

from __future__ import annotations

from proto import messages as m
from tests.unit.scheduler_fakes import EOS, Sim, fake_logprob, prompt
from tests.unit.test_scheduler_core import ready


def prompt_positions(sim: Sim, request_id: str) -> list[float]:
    """The positions the streamed prompt log-probabilities were computed for (fake_logprob says it)."""
    return [round(-entry.logprob * 100) for d in sim.deltas(request_id) for entry in d.prompt_logprobs or []]


def test_completion_logprobs_come_with_their_tokens_and_are_cut_at_the_stop_token() -> None:
    sim = Sim()
    worker, draft = ready(sim), sim.draft().start()
    sim.submit("a", prompt(3), max_tokens=10, logprobs=2)
    worker.complete({"a": [10]})
    draft.answer({"a": [11, 12, EOS, 13]})
    worker.complete({"a": [11, 12, EOS, 13, 14]})
    assert all(seq.logprobs == 2 and seq.prompt_logprobs == -1 for seq in worker.seqs_of("a"))
    deltas = [d for d in sim.deltas("a") if d.token_ids]
    assert [d.token_ids for d in deltas] == [[10], [11, 12, EOS]]
    assert [d.logprobs for d in deltas] == [
        [fake_logprob(3, 10, 2)],
        [fake_logprob(4, 11, 2), fake_logprob(5, 12, 2), fake_logprob(6, EOS, 2)],
    ]


def test_without_logprobs_none_are_asked_or_sent() -> None:
    sim = Sim()
    worker = ready(sim)
    sim.submit("a", prompt(3), max_tokens=2)
    worker.run()
    assert all(seq.logprobs == -1 and seq.prompt_logprobs == -1 for seq in worker.seqs_of("a"))
    assert all(d.logprobs is None and d.prompt_logprobs is None for d in sim.deltas("a"))


def test_a_chunked_prompt_is_scored_once_per_position_and_bypasses_the_prefix_cache() -> None:
    sim = Sim(max_num_batched_tokens=16)
    worker = sim.worker("w0", num_kv_pages=64, kv_page_size=4).start()
    tokens = prompt(40)
    sim.submit("warm", tokens, max_tokens=1)  # fills the prefix cache with the prompt's pages
    worker.run()
    sim.submit("a", tokens, max_tokens=2, prompt_logprobs=1)
    worker.run()
    chunks = [(s.start_position, len(s.token_ids), s.prompt_logprobs, s.after_token_id) for s in worker.seqs_of("a")]
    assert chunks == [(0, 16, 1, tokens[16]), (16, 16, 1, tokens[32]), (32, 8, 1, -1), (40, 1, -1, -1)]
    assert prompt_positions(sim, "a") == list(range(1, 40))
    assert sim.deltas("a")[-1].num_cached_tokens == 0
    sim.submit("b", tokens, max_tokens=1)  # without prompt log-probabilities the cache serves
    worker.run()
    assert sim.deltas("b")[-1].num_cached_tokens == 36


def test_max_tokens_zero_scores_the_prompt_and_finishes_with_length_and_no_token() -> None:
    sim = Sim()
    worker = ready(sim)
    sim.submit("a", prompt(5), max_tokens=0, prompt_logprobs=0, logprobs=0)
    worker.run()
    assert prompt_positions(sim, "a") == [1, 2, 3, 4]
    assert sim.streamed("a") == [] and sim.finish_reason("a") == "length"
    assert len(worker.all_steps()) == 1


def test_max_tokens_zero_without_prompt_logprobs_and_out_of_range_counts_are_refused() -> None:
    sim = Sim()
    ready(sim)
    sim.submit("a", prompt(5), max_tokens=0)
    sim.submit("b", prompt(5), logprobs=m.MAX_TOP_LOGPROBS + 1)
    sim.submit("c", prompt(5), prompt_logprobs=-1)
    assert [e.message for e in sim.errors()] == [
        "max_tokens must be at least 1, got 0",
        "logprobs must be 0 to 20, got 21",
        "prompt_logprobs must be 0 to 20, got -1",
    ]


def test_a_prompt_recomputed_after_its_worker_is_lost_is_not_scored_twice() -> None:
    sim = Sim(max_num_batched_tokens=8)
    w0 = ready(sim, "w0")
    sim.submit("a", prompt(20), max_tokens=2, prompt_logprobs=0)
    w0.complete()
    w0.complete()  # positions 1..16 are scored
    w0.fail()
    w1 = ready(sim, "w1")
    w1.run()
    assert prompt_positions(sim, "a") == list(range(1, 20))
    assert [s.start_position for s in w1.seqs_of("a")][:3] == [0, 8, 16]  # recomputed from the start, no cache
    assert sim.finish_reason("a") == "length"


def test_a_result_without_the_logprobs_asked_loses_the_worker() -> None:
    sim = Sim()
    worker = ready(sim)
    sim.submit("a", prompt(3), max_tokens=3, logprobs=1)
    step = worker.step()
    worker.send(m.StepResult("w0", 1, step.step_id, [m.SeqOutput("a", [11])], 3.0))
    assert sim.process("w0").state == "FAILED"
    assert "a: log-probabilities missing" in sim.process("w0").failure
    assert sim.streamed("a") == []


def test_a_penalized_request_sends_the_tokens_before_each_sampling_step() -> None:
    sim = Sim(max_num_batched_tokens=4)
    worker = ready(sim)
    penalties = m.Penalties(frequency=0.5, logit_bias={7: 1.0})
    sim.submit("a", prompt(6), max_tokens=3, sampling=m.SamplingParams(penalties=penalties))
    sim.submit("b", prompt(2, first=300), max_tokens=2)
    worker.run({"a": [10, 11, 12]})
    sent = [(s.start_position, s.sample, s.history, s.num_prompt_tokens) for s in worker.seqs_of("a")]
    assert sent == [
        (0, False, None, 6),
        (4, True, prompt(4), 6),
        (6, True, prompt(6), 6),
        (7, True, prompt(6) + [10], 6),
    ]
    assert all(s.history is None for s in worker.seqs_of("b"))
    assert sim.streamed("a") == [10, 11, 12]


def test_out_of_range_penalties_are_refused_naming_them() -> None:
    sim = Sim()
    ready(sim)
    for index, penalties in enumerate(
        (
            m.Penalties(presence=2.5),
            m.Penalties(repetition=0.005),
            m.Penalties(logit_bias={1: 200.0}),
            m.Penalties(min_tokens=-1),
        )
    ):
        sim.submit(f"r{index}", prompt(3), sampling=m.SamplingParams(penalties=penalties))
    sim.submit("ids", prompt(3), sampling=m.SamplingParams(penalties=m.Penalties(logit_bias={-1: 1.0})))
    assert [e.message for e in sim.errors()] == [
        "presence_penalty 2.5 is outside -2.0 .. 2.0",
        "repetition_penalty 0.005 is outside 0.01 .. 100.0",
        "logit_bias of token 1 is 200.0, outside -100.0 .. 100.0",
        "min_tokens -1 is negative",
        "logit_bias holds -1, outside the vocabulary of 49152 ids",
    ]
