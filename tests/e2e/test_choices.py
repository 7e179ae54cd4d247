"""`n` and `best_of` through a real stack with the official `openai` client.

A prompt's copies share its computed pages (they start once the first copy's prompt is
computed, and read it from the prefix cache); each copy has its own seed stream, so a
seeded request is reproducible; best_of returns the copies with the highest
log-probability per token.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from proto import specserve_pb2 as pb
from tests.e2e.stack import Stack
from tests.e2e.test_http_api import MODEL, client

# Long enough for full KV pages (16 positions) that the copies can share.
PROMPT = (
    "Here is a short story about a lighthouse keeper who lives alone on a rocky island far from the coast, "
    "and one stormy night"
)


def test_n_seeded_choices_are_reproducible_share_the_prompt_and_stream_the_same(fp32_stack: Stack) -> None:
    api = client(fp32_stack)
    asked: dict[str, Any] = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 0.9,
        "seed": 7,
        "n": 3,
        "extra_body": {"ignore_eos": True},
    }
    first = api.completions.create(**asked)
    again = api.completions.create(**asked)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert len(set(texts)) > 1  # their own seed streams
    usage = first.usage
    assert usage is not None and usage.completion_tokens == 30
    num_prompt = usage.prompt_tokens
    single = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert single.usage is not None and single.usage.prompt_tokens == num_prompt  # counted once
    # Cached tokens are the prompt's, counted once like it, not once per copy; the second run's prompt is all cached
    # but its last token (which is computed for its logits).
    again_details = again.usage.prompt_tokens_details if again.usage is not None else None
    assert again_details is not None and again_details.cached_tokens == (num_prompt - 1) // 16 * 16
    details = usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None and details.cached_tokens <= num_prompt
    streamed = list(api.completions.create(**asked, stream=True))
    for index, text in enumerate(texts):
        assert "".join(e.choices[0].text for e in streamed if e.choices and e.choices[0].index == index) == text
    # n = 1 with the same seed is the first copy.
    assert api.completions.create(**{**asked, "n": 1}).choices[0].text == texts[0]


def test_best_of_returns_the_copies_with_the_highest_logprob_per_token(fp32_stack: Stack) -> None:
    api = client(fp32_stack)
    asked: dict[str, Any] = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 11,
        "extra_body": {"ignore_eos": True},
    }
    every = api.completions.create(**asked, n=4, logprobs=0).choices
    means = [sum(c.logprobs.token_logprobs) / 8 for c in every]  # type: ignore[union-attr, arg-type]
    ranked = [every[i].text for i in sorted(range(4), key=lambda i: -means[i])]
    best = api.completions.create(**asked, n=2, best_of=4)
    assert [c.text for c in best.choices] == ranked[:2] and [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)  # used to rank, not asked for
    assert best.usage is not None and best.usage.completion_tokens == 32  # every copy ran


def test_chat_n_greedy_choices_are_equal(fp32_stack: Stack) -> None:
    api = client(fp32_stack)
    answer = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6, temperature=0, n=2
    )
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.choices[0].message.content == answer.choices[1].message.content


def test_grpc_n_streams_every_choice_by_its_index_as_http_gives_them(fp32_stack: Stack) -> None:
    params = pb.SamplingParams(max_tokens=6, temperature=0.9, seed=7, ignore_eos=True)
    responses = list(fp32_stack.stub.Generate(pb.GenerateRequest(prompt=PROMPT, params=params, n=3), timeout=120))
    texts = {index: "".join(r.text for r in responses if r.choice_index == index) for index in range(3)}
    finals = [r for r in responses if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert sorted(r.choice_index for r in finals) == [0, 1, 2] and all(r.usage.completion_tokens == 6 for r in finals)
    http = client(fp32_stack).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.9, seed=7, n=3, extra_body={"ignore_eos": True}
    )
    assert [texts[c.index] for c in http.choices] == [c.text for c in http.choices]
    with pytest.raises(grpc.RpcError) as caught:
        list(fp32_stack.stub.Generate(pb.GenerateRequest(prompt=PROMPT, n=0), timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n:" in (caught.value.details() or "")
