"""Penalties on logits: each one as defined, and on the target runner the same for a token whether it was decoded
alone or verified as a draft of a chain or a tree, greedy or sampled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modeling.model.batch import PageError
from modeling.sampling.penalties import penalize
from proto.messages import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, Penalties, SamplingParams, SeqWork
from tests.unit.test_verify_and_propose import GREEDY, PROMPT, pages, runner

PENALIZED = Penalties(presence=0.5, frequency=0.7, repetition=1.3, logit_bias={3: 2.0, 4: -1.5})


def test_each_penalty_is_applied_as_defined_in_order() -> None:
    logits = torch.tensor([1.0, -2.0, 3.0, 0.5, 4.0, -1.0])
    prefix = [0, 1, 2, 2, 4]  # the prompt is [0, 1]; the completion [2, 2, 4]
    row = logits.clone()
    penalize(row, prefix, 2, PENALIZED)
    expected = logits.clone()
    expected[3] += 2.0
    expected[4] -= 1.5
    for token in (0, 1, 2, 4):  # in the prompt or the completion
        expected[token] = expected[token] / 1.3 if expected[token] > 0 else expected[token] * 1.3
    expected[2] -= 2 * 0.7 + 0.5  # twice in the completion
    expected[4] -= 0.7 + 0.5
    assert torch.equal(row, expected)
    held = logits.clone()
    penalize(held, prefix, 2, Penalties(min_tokens=4, stop_token_ids=[5, 1]))  # 3 completion tokens so far
    assert held[5] == held[1] == float("-inf") and torch.equal(held[[0, 2, 3, 4]], logits[[0, 2, 3, 4]])
    free = logits.clone()
    penalize(free, prefix, 2, Penalties(min_tokens=3, stop_token_ids=[5, 1]))
    assert torch.equal(free, logits)


def test_a_repetition_penalty_within_its_bounds_keeps_every_logit_and_log_probability_finite() -> None:
    logits = torch.tensor([3e4, -3e4, 1e-30, 0.0, 1e36, -1e36, 5.0])  # float32, far past any model's own
    prefix = list(range(7))
    for repetition in (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY):  # a logit moves by 100 times at most
        row = logits.clone()
        penalize(row, prefix, 2, Penalties(repetition=repetition))
        assert torch.isfinite(row).all() and torch.isfinite(torch.log_softmax(row, dim=-1)).all(), repetition
    below = logits.clone()
    penalize(below, prefix, 2, Penalties(repetition=1e-300))  # 0 in float32: what the lower bound refuses
    assert not torch.isfinite(torch.log_softmax(below, dim=-1)).all()


def decode(r, request_id: str, slot: int, params: SamplingParams, n: int, propose=None, parents=None):  # type: ignore[no-untyped-def]
    """Decode n tokens, with drafts from propose(tokens so far) when given; every step sends the history."""
    (out,), _, _ = r.execute(
        [
            SeqWork(
                request_id, pages(slot), 0, PROMPT, True, params, history=[], num_prompt_tokens=len(PROMPT), logprobs=2
            )
        ]
    )
    tokens, logprobs = list(out.token_ids), list(out.logprobs)
    while len(tokens) < n:
        sequence = PROMPT + tokens
        drafts = propose(tokens) if propose else []
        (out,), _, _ = r.execute(
            [
                SeqWork(
                    request_id,
                    pages(slot),
                    len(sequence) - 1,
                    [sequence[-1], *drafts],
                    True,
                    params,
                    num_draft_tokens=len(drafts),
                    draft_parents=parents if drafts else None,
                    history=sequence[:-1],
                    num_prompt_tokens=len(PROMPT),
                    logprobs=2,
                )
            ]
        )
        tokens += out.token_ids
        logprobs += out.logprobs
    return tokens[:n], logprobs[:n]


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_penalized_decoding_is_the_same_with_chain_and_tree_drafts(tiny_llama_folder: Path, temperature: float) -> None:
    params = SamplingParams(temperature=temperature, seed=5, penalties=PENALIZED)
    r = runner(tiny_llama_folder)
    plain, plain_logprobs = decode(r, "p", 0, params, 16)
    unpenalized, unpenalized_logprobs = decode(r, "u", 1, SamplingParams(temperature=temperature, seed=5), 16)
    assert plain_logprobs[0] != unpenalized_logprobs[0]  # the penalties change the distribution
    truth = plain
    chain = lambda tokens: [*truth[len(tokens) : len(tokens) + 2], 1]  # noqa: E731  two right, one wrong
    tree = lambda tokens: [*truth[len(tokens) : len(tokens) + 1], 1, 2]  # noqa: E731  a right root, a wrong one under it
    for propose, parents in ((chain, None), (tree, [-1, 0, -1])):
        r = runner(tiny_llama_folder)
        tokens, logprobs = decode(r, "s", 2, params, 16, propose, parents)
        assert tokens == plain and logprobs == plain_logprobs


def test_a_large_logit_bias_forces_its_token_and_min_tokens_holds_back_the_stop_tokens(tiny_llama_folder: Path) -> None:
    r = runner(tiny_llama_folder)
    forced, _ = decode(r, "f", 0, SamplingParams(penalties=Penalties(logit_bias={42: 100.0})), 5)
    assert forced == [42] * 5
    free, _ = decode(r, "g", 1, GREEDY, 6)
    stop = free[0]
    held, _ = decode(r, "h", 2, SamplingParams(penalties=Penalties(min_tokens=6, stop_token_ids=[stop])), 6)
    assert stop not in held
    unheld, _ = decode(r, "u", 3, SamplingParams(penalties=Penalties(min_tokens=0, stop_token_ids=[stop])), 6)
    assert unheld == free


def test_penalties_without_the_history_they_count_are_refused_as_the_requests_own(tiny_llama_folder: Path) -> None:
    r = runner(tiny_llama_folder)
    params = SamplingParams(penalties=PENALIZED)
    for work in (
        SeqWork("x", pages(0), 0, PROMPT, True, params),  # no history
        SeqWork("x", pages(0), 3, PROMPT[3:], True, params, history=PROMPT[:2]),  # too short
        SeqWork(
            "x", pages(0), 0, PROMPT, True, SamplingParams(penalties=Penalties(logit_bias={10**6: 1.0})), history=[]
        ),
    ):
        with pytest.raises(PageError) as caught:
            r.execute([work])
        assert caught.value.request_id == "x"
