"""Log-probabilities through a real stack: the official `openai` client and gRPC, streamed and whole, against the
same weights in Hugging Face transformers.

Completion tokens' values are the model's after temperature (a greedy request's: its own),
with the asked-for likeliest tokens; an echoed prompt's are the model's own, its first
token without one, and `max_tokens: 0` scores a prompt alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from common.text.tokenizer import Tokenizer
from proto import specserve_pb2 as pb
from tests.e2e.reference import ReferenceModel
from tests.e2e.stack import Stack
from tests.e2e.test_http_api import MODEL, call, client

TOLERANCE = 2e-3  # float32 kernels other than transformers' sum in another order
PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def reference(default_model_dir: Path) -> Iterator[ReferenceModel]:
    yield ReferenceModel(default_model_dir, torch.float32)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.load(default_model_dir)


def test_completion_logprobs_are_the_models_and_stream_as_they_come_whole(
    fp32_stack: Stack, reference: ReferenceModel, tokenizer: Tokenizer
) -> None:
    api = client(fp32_stack)
    whole = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    events = list(
        api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, stream=True)
    )
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert logprobs.top_logprobs is not None and logprobs.text_offset is not None
    streamed: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for event in events:
        if event.choices and event.choices[0].logprobs is not None:
            for key in streamed:
                streamed[key] += getattr(event.choices[0].logprobs, key)
    assert streamed == {
        "tokens": logprobs.tokens,
        "token_logprobs": logprobs.token_logprobs,
        "top_logprobs": logprobs.top_logprobs,
        "text_offset": logprobs.text_offset,
    }
    assert "".join(logprobs.tokens) == whole.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(8)]

    prompt_ids = tokenizer.encode(PROMPT)
    greedy = reference.greedy(prompt_ids, 8).token_ids
    expected = reference.log_softmax(prompt_ids + greedy)[len(prompt_ids) - 1 : -1]  # before each completion token
    for i, (token_id, value, top) in enumerate(zip(greedy, logprobs.token_logprobs, logprobs.top_logprobs)):
        assert value == pytest.approx(float(expected[i, token_id]), abs=TOLERANCE)
        best = torch.topk(expected[i], 3)
        want = {tokenizer.token_text(int(t)): float(v) for t, v in zip(best.indices, best.values)}
        assert top.keys() == want.keys() and len(top) == 3  # greedy: the token is the likeliest, listed once
        assert list(top.values()) == pytest.approx(list(want.values()), abs=TOLERANCE)
        assert value == max(top.values())


def test_echo_with_max_tokens_zero_scores_the_prompt(
    fp32_stack: Stack, reference: ReferenceModel, tokenizer: Tokenizer
) -> None:
    api = client(fp32_stack)
    prompt_ids = tokenizer.encode(PROMPT)
    answer = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = answer.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert answer.usage is not None and (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
        len(prompt_ids),
        0,
    )
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert choice.logprobs.tokens == [tokenizer.token_text(t) for t in prompt_ids]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None  # type: ignore[index]
    expected = reference.log_softmax(prompt_ids)
    for position in range(1, len(prompt_ids)):
        assert choice.logprobs.token_logprobs[position] == pytest.approx(
            float(expected[position - 1, prompt_ids[position]]), abs=TOLERANCE
        )
    # Echo and generation at once, as lm-evaluation-harness asks (a list of token-id prompts: one choice each),
    # streamed the same.
    body = {"prompt": [prompt_ids, prompt_ids[:3]], "max_tokens": 2, "echo": True, "logprobs": 1, "temperature": 0}
    status, whole = call(fp32_stack, "POST", "/v1/completions", body)
    assert status == 200 and isinstance(whole, dict), whole
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    first = whole["choices"][0]["logprobs"]
    assert first["token_logprobs"][: len(prompt_ids)] == choice.logprobs.token_logprobs
    assert len(first["tokens"]) == len(prompt_ids) + 2 and whole["choices"][0]["text"].startswith(PROMPT)
    assert whole["usage"]["completion_tokens"] == 4
    streamed = list(
        api.completions.create(
            model=MODEL,
            prompt=[prompt_ids, prompt_ids[:3]],
            max_tokens=2,
            echo=True,
            logprobs=1,
            temperature=0,
            stream=True,
        )
    )
    for index in (0, 1):
        parts = [e.choices[0] for e in streamed if e.choices and e.choices[0].index == index]
        assert "".join(p.text for p in parts) == whole["choices"][index]["text"]
        values = [v for p in parts if p.logprobs is not None for v in p.logprobs.token_logprobs or []]
        assert values == whole["choices"][index]["logprobs"]["token_logprobs"]


def test_chat_logprobs_whole_and_streamed(fp32_stack: Stack) -> None:
    api = client(fp32_stack)
    messages: list[Any] = [{"role": "user", "content": "Name a colour."}]
    whole = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    assert "".join(c.token for c in content) == whole.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes == list(entry.token.encode())
    streamed = list(
        api.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, stream=True
        )
    )
    parts = [c for e in streamed if e.choices and e.choices[0].logprobs for c in e.choices[0].logprobs.content or []]
    assert [(p.token, p.logprob) for p in parts] == [(c.token, c.logprob) for c in content]
    plain = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_sampled_logprobs_follow_the_temperature_and_grpc_carries_them(
    fp32_stack: Stack, reference: ReferenceModel, tokenizer: Tokenizer
) -> None:
    prompt_ids = tokenizer.encode(PROMPT)
    params = pb.SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, seed=3, logprobs=2, prompt_logprobs=1)
    result = list(
        fp32_stack.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids), params=params), timeout=120)
    )
    tokens = [t for r in result for t in r.token_ids]
    entries = [e for r in result for e in r.logprobs]
    scored = [e for r in result for e in r.prompt_logprobs]
    assert [e.token_id for e in entries] == tokens and len(tokens) == 5
    assert [e.token_id for e in scored] == prompt_ids[1:]
    expected = reference.log_softmax(prompt_ids + tokens)
    for i, entry in enumerate(entries):
        after_temperature = torch.log_softmax(
            expected[len(prompt_ids) - 1 + i] / 0.7, dim=-1
        )  # logits up to a constant
        assert entry.logprob == pytest.approx(float(after_temperature[tokens[i]]), abs=TOLERANCE)
        assert [t.token_id for t in entry.top_logprobs] == torch.topk(after_temperature, 2).indices.tolist()
    for i, entry in enumerate(scored):
        assert entry.logprob == pytest.approx(float(expected[i, prompt_ids[i + 1]]), abs=TOLERANCE)
        assert len(entry.top_logprobs) == 1 and entry.top_logprobs[0].logprob >= entry.logprob
    assert all(math.isfinite(e.logprob) for e in entries + scored)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only scores an echoed prompt
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
    ],
)
def test_bad_logprob_parameters_are_400_naming_the_field(
    fp32_stack: Stack, path: str, body: dict[str, Any], param: str
) -> None:
    status, answer = call(fp32_stack, "POST", path, body)
    assert status == 400 and isinstance(answer, dict) and answer["error"]["param"] == param, answer


def test_grpc_refuses_bad_logprob_counts_naming_the_field(fp32_stack: Stack) -> None:
    import grpc

    for params, field in (
        (pb.SamplingParams(logprobs=21), "params.logprobs"),
        (pb.SamplingParams(prompt_logprobs=-1), "params.prompt_logprobs"),
        (pb.SamplingParams(max_tokens=0), "params.max_tokens"),
    ):
        with pytest.raises(grpc.RpcError) as caught:
            list(fp32_stack.stub.Generate(pb.GenerateRequest(prompt="x", params=params), timeout=30))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in (caught.value.details() or "")
    whole = list(
        fp32_stack.stub.Generate(
            pb.GenerateRequest(prompt="x y z", params=pb.SamplingParams(max_tokens=0, prompt_logprobs=0)), timeout=30
        )
    )
    assert [t for r in whole for t in r.token_ids] == [] and whole[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len([e for r in whole for e in r.prompt_logprobs]) == whole[-1].usage.prompt_tokens - 1


def test_the_openai_error_for_a_bad_logprob_count_is_an_api_error(fp32_stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError):
        client(fp32_stack).completions.create(model=MODEL, prompt="x", logprobs=25)
