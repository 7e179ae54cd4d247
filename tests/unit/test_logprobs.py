"""Log-probabilities on the target runner, on a tiny random model: what the model's own logits say, the same for a
token whether it was decoded alone, verified as a draft or sampled, and a prompt scored in chunks as at once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modeling.model.batch import PageError, SeqSpan
from modeling.sampling.logprobs import token_logprobs
from proto.messages import SamplingParams, SeqWork, TokenLogprob
from tests.unit.test_verify_and_propose import GREEDY, PROMPT, pages, plain_greedy, runner

SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=11)


def test_token_logprobs_are_the_log_softmax_after_temperature_with_the_likeliest_first() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 4
    tokens = [7, 0, 49]
    for temperature, scale in ((0.0, 1.0), (1e-6, 1.0), (0.5, 2.0), (2.0, 0.5)):  # below 1e-5 is greedy: unscaled
        entries = token_logprobs(logits, tokens, 4, temperature)
        expected = torch.log_softmax(logits * scale, dim=-1)
        for row, (token, entry) in enumerate(zip(tokens, entries)):
            assert entry.logprob == pytest.approx(float(expected[row, token]), abs=1e-5)
            best = torch.topk(expected[row], 4)
            assert [t.token_id for t in entry.top] == best.indices.tolist()
            assert [t.logprob for t in entry.top] == pytest.approx(best.values.tolist(), abs=1e-5)
    assert [e.top for e in token_logprobs(logits, tokens, 0)] == [[], [], []]
    with pytest.raises(ValueError, match="2 rows of logits for 3 tokens"):
        token_logprobs(logits[:2], tokens, 1)


def decode_with_logprobs(
    tiny_llama_folder: Path, params: SamplingParams, n: int
) -> tuple[list[int], list[TokenLogprob]]:
    r = runner(tiny_llama_folder)
    (out,), _, _ = r.execute([SeqWork("p", pages(0), 0, PROMPT, True, params, logprobs=3)])
    tokens, logprobs = list(out.token_ids), list(out.logprobs or [])
    while len(tokens) < n:
        (out,), _, _ = r.execute(
            [SeqWork("p", pages(0), len(PROMPT) + len(tokens) - 1, [tokens[-1]], True, params, logprobs=3)]
        )
        tokens += out.token_ids
        logprobs += out.logprobs or []
    return tokens, logprobs


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_verified_draft_token_has_the_logprob_of_its_decode_step(
    tiny_llama_folder: Path, params: SamplingParams
) -> None:
    tokens, expected = decode_with_logprobs(tiny_llama_folder, params, 12)
    r = runner(tiny_llama_folder)
    (out,), _, _ = r.execute([SeqWork("s", pages(1), 0, PROMPT, True, params, logprobs=3)])
    got, logprobs = list(out.token_ids), list(out.logprobs or [])
    while len(got) < 12:
        truth = tokens[len(got) : len(got) + 4]
        drafts = truth[:2] + [(t + 1) % 97 for t in truth[2:]]  # two right, then wrong ones
        (out,), _, _ = r.execute(
            [
                SeqWork(
                    "s",
                    pages(1),
                    len(PROMPT) + len(got) - 1,
                    [got[-1], *drafts],
                    True,
                    params,
                    num_draft_tokens=len(drafts),
                    logprobs=3,
                )
            ]
        )
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        got += out.token_ids
        logprobs += out.logprobs
    assert got[:12] == tokens
    assert logprobs[:12] == expected  # bit for bit: the rows are the decode steps'
    if params is GREEDY:  # a greedy token is the likeliest
        assert all(entry.top[0].logprob == entry.logprob for entry in logprobs)


def test_a_prompt_scored_in_chunks_equals_its_logits_at_once(tiny_llama_folder: Path) -> None:
    r = runner(tiny_llama_folder)
    logits = r._engine.forward([SeqSpan(tuple(pages(0)), 0, PROMPT, len(PROMPT))])  # every position's logits
    expected = token_logprobs(logits[:-1], PROMPT[1:], 2)
    r = runner(tiny_llama_folder)
    _, _, (first,) = r.execute(
        [SeqWork("c", pages(0), 0, PROMPT[:4], False, GREEDY, prompt_logprobs=2, after_token_id=PROMPT[4])]
    )
    (out,), _, (rest,) = r.execute([SeqWork("c", pages(0), 4, PROMPT[4:], True, GREEDY, prompt_logprobs=2, logprobs=1)])
    assert (first.first_position, rest.first_position) == (1, 5)
    assert len(first.entries) == 4 and len(rest.entries) == len(PROMPT) - 5
    scored = first.entries + rest.entries
    for got, want in zip(scored, expected, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t.token_id for t in got.top] == [t.token_id for t in want.top]
    assert out.token_ids == plain_greedy(runner(tiny_llama_folder), 0, PROMPT, 1)[:1]
    assert out.logprobs is not None and out.logprobs[0].top[0].token_id == out.token_ids[0]


def test_bad_logprob_asks_are_refused_as_the_requests_own(tiny_llama_folder: Path) -> None:
    r = runner(tiny_llama_folder)
    for work in (
        SeqWork("x", pages(0), 0, PROMPT, True, GREEDY, logprobs=21),
        SeqWork("x", pages(0), 0, PROMPT, True, GREEDY, prompt_logprobs=-2),
        SeqWork("x", pages(0), 0, PROMPT[:3], False, GREEDY, after_token_id=5),
        SeqWork("x", pages(0), 0, PROMPT[:3], False, GREEDY, prompt_logprobs=0, after_token_id=10**6),
    ):
        with pytest.raises(PageError) as caught:
            r.execute([work])
        assert caught.value.request_id == "x"
