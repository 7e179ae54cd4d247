"""The OpenAI-compatible HTTP API on a real stack, called with the official `openai` client.

Greedy text equals the gRPC API's for the same prompt; every error has its HTTP status and
an OpenAI-format body; /ready follows READY workers; /metrics parses and its token
counters match what clients received; a client that goes away mid-stream frees its KV.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proto import specserve_pb2 as pb
from tests.e2e.conftest import workerless_stack
from specserve.stack import StackConfig
from tests.e2e.stack import Stack

MODEL = "SmolLM2-135M-Instruct"


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{stack.addresses.http_port}/v1", api_key="unused", max_retries=0, timeout=120
    )


def call(stack: Stack, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any] | str]:
    connection = http.client.HTTPConnection("127.0.0.1", stack.addresses.http_port, timeout=60)
    try:
        connection.request(
            method,
            path,
            body=json.dumps(body) if body is not None else None,
            headers={"Content-Type": "application/json"},
        )
        response = connection.getresponse()
        text = response.read().decode()
        try:
            return response.status, json.loads(text)
        except json.JSONDecodeError:
            return response.status, text
    finally:
        connection.close()


def grpc_text(stack: Stack, request: pb.GenerateRequest) -> str:
    return stack.generate(request).text


def metric(stack: Stack, name: str, labels: dict[str, str] | None = None) -> float:
    status, text = call(stack, "GET", "/metrics")
    assert status == 200 and isinstance(text, str)
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += sample.value
    return total


def test_completions_with_the_openai_client_equal_grpc(fp32_stack: Stack) -> None:
    api = client(fp32_stack)
    prompt = "The capital of France is"
    whole = api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    streamed = api.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    events = list(streamed)
    text = "".join(e.choices[0].text for e in events if e.choices)
    reference = grpc_text(fp32_stack, pb.GenerateRequest(prompt=prompt, params=pb.SamplingParams(max_tokens=12)))
    assert whole.choices[0].text == text == reference
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == 12 and events[-1].choices == []
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"


def test_chat_completions_with_the_openai_client_equal_grpc(fp32_stack: Stack) -> None:
    api = client(fp32_stack)
    messages: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]
    whole = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    streamed = list(
        api.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True)
    )
    text = "".join(e.choices[0].delta.content or "" for e in streamed if e.choices)
    reference = grpc_text(
        fp32_stack,
        pb.GenerateRequest(
            chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")]),
            params=pb.SamplingParams(max_tokens=24),
        ),
    )
    assert whole.choices[0].message.content == text == reference
    assert whole.choices[0].message.role == "assistant" and streamed[0].choices[0].delta.role == "assistant"
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert [m.id for m in api.models.list()] == [MODEL]


def test_sampling_parameters_and_stop_strings_reach_the_scheduler(fp32_stack: Stack) -> None:
    api = client(fp32_stack)
    seeded = [
        api.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=16,
            temperature=0.9,
            top_p=0.9,
            seed=7,
            extra_body={"top_k": 40},
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    # min_p 1 keeps only the likeliest token: a sampled answer is the greedy one, over HTTP and gRPC alike.
    greedy = api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    best_only = api.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=3, extra_body={"min_p": 1.0}
    )
    assert best_only.choices[0].text == greedy.choices[0].text
    over_grpc = fp32_stack.generate(
        pb.GenerateRequest(
            prompt="Once upon a time", params=pb.SamplingParams(max_tokens=12, temperature=1.0, seed=3, min_p=1.0)
        )
    )
    assert over_grpc.text == greedy.choices[0].text
    stopped = api.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=32, temperature=0, stop=[" 7"])
    assert stopped.choices[0].finish_reason == "stop" and " 7" not in stopped.choices[0].text


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
        ({"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "stop": [1]}, "stop"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logprobs": "all"}, "logprobs"),
        # Numbers past what the fields hold: a 400 naming the field, never a 500.
        ({"prompt": "x", "max_tokens": 2**31}, "max_tokens"),
        ({"prompt": "x", "top_k": 2**40}, "top_k"),
        ({"prompt": "x", "temperature": 10**400}, "temperature"),
        ({"prompt": [1, 2**40]}, "prompt"),
        ({"prompt": [1, 49152]}, "prompt"),  # outside the vocabulary: named as the client's field
        # What this server does not do is refused, never silently ignored.
        ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": "x", "suffix": "end"}, "suffix"),
        ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"prompt": "x", "min_p": 1.5}, "min_p"),
        ({"prompt": "x", "wibble": 1}, "wibble"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ({"prompt": "x", "logit_bias": {"42": 500}}, "logit_bias[42]"),
        ({"prompt": "x", "logit_bias": {"49152": 1}}, "logit_bias[49152]"),
        ({"messages": [{"role": "", "content": "hi"}]}, "messages[0].role"),
        ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": CHAT, "max_tokens": 0}, "max_tokens"),
        # Text no tokenizer can encode (json.dumps sends a lone surrogate as its escape) and unbounded stop strings.
        ({"prompt": "a\ud800b"}, "prompt"),
        ({"prompt": "x", "stop": ["ok", "\udfff"]}, "stop[1]"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
        ({"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({"prompt": "x", "stop": ["x" * 257]}, "stop[0]"),
    ],
)
def test_bad_parameters_are_400_naming_the_field(fp32_stack: Stack, body: dict[str, Any], param: str) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, answer = call(fp32_stack, "POST", path, body)
    assert status == 400 and isinstance(answer, dict), answer
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["message"]


def test_parameters_that_ask_for_nothing_are_accepted_as_other_servers_accept_them(fp32_stack: Stack) -> None:
    harmless = {
        "echo": False,
        "best_of": 1,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "logprobs": None,
        "top_k": -1,
        "seed": -5,
    }  # top_k -1: no cut, as in vLLM; any int64 seed
    status, answer = call(fp32_stack, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, **harmless})
    assert status == 200 and isinstance(answer, dict), answer
    # A null max_completion_tokens leaves max_tokens in force.
    status, answer = call(
        fp32_stack,
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "max_completion_tokens": None, "max_tokens": 3, "ignore_eos": True},
    )
    assert status == 200 and isinstance(answer, dict) and answer["usage"]["completion_tokens"] == 3, answer


def test_unknown_model_is_404_and_bad_json_400(fp32_stack: Stack) -> None:
    status, answer = call(
        fp32_stack, "POST", "/v1/chat/completions", {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert status == 404 and isinstance(answer, dict)
    assert (answer["error"]["param"], answer["error"]["code"]) == ("model", "model_not_found")
    with pytest.raises(openai.NotFoundError):
        client(fp32_stack).completions.create(model="gpt-17", prompt="x")
    status, answer = call(fp32_stack, "POST", "/v1/chat/completions", {"messages": "hello"})
    assert status == 400 and isinstance(answer, dict) and answer["error"]["param"] == "messages"


def test_metrics_parse_and_count_the_tokens_clients_received(fp32_stack: Stack) -> None:
    before = {api: metric(fp32_stack, "specserve_generation_tokens_total", {"api": api}) for api in ("http", "grpc")}
    api = client(fp32_stack)
    received = {"http": 0, "grpc": 0}
    for max_tokens in (3, 9):
        received["http"] += api.completions.create(
            model=MODEL, prompt="Hello", max_tokens=max_tokens, temperature=0
        ).usage.completion_tokens  # type: ignore[union-attr]
        streamed = list(
            api.completions.create(
                model=MODEL,
                prompt="Bye",
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        received["http"] += streamed[-1].usage.completion_tokens  # type: ignore[union-attr]
        received["grpc"] += len(
            fp32_stack.generate(
                pb.GenerateRequest(prompt="Hi", params=pb.SamplingParams(max_tokens=max_tokens))
            ).token_ids
        )
    stopped = api.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=32, temperature=0, stop=[" 7"])
    received["http"] += stopped.usage.completion_tokens  # type: ignore[union-attr]
    for name in ("http", "grpc"):
        assert metric(fp32_stack, "specserve_generation_tokens_total", {"api": name}) - before[name] == received[name]
    assert metric(fp32_stack, "specserve_requests_total", {"api": "http", "outcome": "length"}) >= 4
    assert metric(fp32_stack, "specserve_time_to_first_token_seconds_count", {"api": "http"}) >= 5
    assert metric(fp32_stack, "specserve_inter_token_latency_seconds_count") > 0
    assert metric(fp32_stack, "specserve_process_state", {"process_id": "worker-0", "state": "READY"}) == 1
    assert metric(fp32_stack, "specserve_scheduler_up") == 1
    assert metric(fp32_stack, "specserve_speculation_decisions_total", {"k": "0"}) > 0


def test_a_client_leaving_mid_stream_frees_its_kv(fp32_stack: Stack) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", fp32_stack.addresses.http_port, timeout=60)
    body = {
        "model": MODEL,
        "prompt": "Count: 1, 2, 3,",
        "max_tokens": 1500,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    connection.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    for _ in range(5):
        assert response.readline().startswith(b"data: ")
        response.readline()
    assert fp32_stack.info().num_running == 1
    connection.sock.close()  # type: ignore[union-attr]
    connection.close()
    fp32_stack.wait_idle(timeout_s=10)  # the request was aborted and its slot freed
    assert metric(fp32_stack, "specserve_requests_total", {"api": "http", "outcome": "cancelled"}) >= 1


@pytest.fixture(scope="module")
def lonely_stack(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A scheduler and a gateway; workers come and go in the test. A queue of 1."""
    options = StackConfig(
        default_model_dir,
        num_workers=0,
        max_num_seqs=1,
        scheduler_args=("--max-queue-len", "1", "--no-worker-timeout-s", "4", "--heartbeat-timeout-s", "2"),
    )
    yield from workerless_stack(options, tmp_path_factory.mktemp("lonely_stack"))


def test_ready_follows_ready_workers_and_errors_without_one_are_503_and_429(lonely_stack: Stack) -> None:
    assert call(lonely_stack, "GET", "/health")[0] == 200
    assert call(lonely_stack, "GET", "/ready")[0] == 503  # no worker yet
    assert call(lonely_stack, "GET", "/v1/models") == (200, {"object": "list", "data": []})  # nothing serves it yet
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(call, lonely_stack, "POST", "/v1/completions", body)
        _wait(lambda: lonely_stack.info().num_waiting == 1, 30)
        status, answer = call(lonely_stack, "POST", "/v1/completions", body)  # the queue of 1 is full
        assert status == 429 and isinstance(answer, dict) and answer["error"]["type"] == "rate_limit_error"
        status, answer = waiting.result(timeout=60)  # no READY worker within --no-worker-timeout-s
    assert status == 503 and isinstance(answer, dict) and "no READY worker" in answer["error"]["message"]

    lonely_stack.start_worker(0)
    _wait(lambda: call(lonely_stack, "GET", "/ready")[0] == 200, 120)
    status, listed = call(lonely_stack, "GET", "/v1/models")
    assert status == 200 and isinstance(listed, dict) and [m["id"] for m in listed["data"]] == [MODEL]
    assert client(lonely_stack).completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2  # type: ignore[union-attr]
    lonely_stack.processes["worker-0"].terminate()
    assert lonely_stack.processes["worker-0"].wait(30) == 0
    _wait(lambda: call(lonely_stack, "GET", "/ready")[0] == 503, 30)  # none READY again
    assert call(lonely_stack, "GET", "/v1/models") == (200, {"object": "list", "data": []})


def _wait(condition, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_penalties_logit_bias_and_min_tokens_reach_the_model(fp32_stack: Stack, default_model_dir: Path) -> None:
    from common.text.tokenizer import Tokenizer

    api = client(fp32_stack)
    (forced_id,) = Tokenizer.load(default_model_dir).encode_raw(" banana")
    forced = api.completions.create(
        model=MODEL, prompt="My favourite fruit is", max_tokens=3, temperature=0, logit_bias={str(forced_id): 100}
    )
    assert forced.choices[0].text == " banana" * 3
    over_grpc = fp32_stack.generate(
        pb.GenerateRequest(
            prompt="My favourite fruit is", params=pb.SamplingParams(max_tokens=3, logit_bias={forced_id: 100.0})
        )
    )
    assert over_grpc.token_ids == [forced_id] * 3
    # A short answer ends at end-of-sequence; min_tokens holds it back.
    messages: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]
    short = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage is not None and short.usage.completion_tokens < 64
    held = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=64, temperature=0, extra_body={"min_tokens": 64}
    )
    assert held.choices[0].finish_reason == "length" and held.usage is not None and held.usage.completion_tokens == 64
    # A priority other than 0 is refused by a first-come-first-served scheduler (the stack's default), not dropped.
    status, refused = call(fp32_stack, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, "priority": 3})
    assert status == 400 and isinstance(refused, dict) and "--scheduling-policy fcfs" in refused["error"]["message"]
    # A stop token id (vLLM's extension) ends the answer where that token comes, as it does over gRPC.
    counted = fp32_stack.generate(pb.GenerateRequest(prompt="1, 2, 3, 4,", params=pb.SamplingParams(max_tokens=8)))
    stop_id = counted.token_ids[3]
    stopped = api.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, extra_body={"stop_token_ids": [stop_id]}
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage is not None
    assert stopped.usage.completion_tokens == counted.token_ids.index(stop_id) + 1
    repeated = "the cat " * 8
    plain = api.completions.create(model=MODEL, prompt=repeated, max_tokens=8, temperature=0)
    penalized = api.completions.create(
        model=MODEL,
        prompt=repeated,
        max_tokens=8,
        temperature=0,
        presence_penalty=2,
        frequency_penalty=2,
        extra_body={"repetition_penalty": 1.5},
    )
    assert "the cat" in plain.choices[0].text and penalized.choices[0].text != plain.choices[0].text


def test_tokenize_counts_what_a_request_is_given_and_detokenize_inverts_it(fp32_stack: Stack) -> None:
    status, counted = call(fp32_stack, "POST", "/tokenize", {"model": MODEL, "prompt": "The capital of France is"})
    assert status == 200 and isinstance(counted, dict) and counted["token_strs"] is None, counted
    status, answer = call(
        fp32_stack, "POST", "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 1}
    )
    assert isinstance(answer, dict) and counted["count"] == len(counted["tokens"]) == answer["usage"]["prompt_tokens"]
    assert counted["max_model_len"] == fp32_stack.info().max_model_len
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    status, chat = call(fp32_stack, "POST", "/tokenize", {"messages": messages, "return_token_strs": True})
    status_chat, answer = call(fp32_stack, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert status == status_chat == 200 and isinstance(chat, dict) and isinstance(answer, dict)
    assert chat["count"] == answer["usage"]["prompt_tokens"] and "".join(chat["token_strs"]).startswith("<|im_start|>")
    status, text = call(fp32_stack, "POST", "/detokenize", {"model": MODEL, "tokens": counted["tokens"]})
    assert status == 200 and text == {"prompt": "The capital of France is"}
    over_grpc = fp32_stack.stub.Tokenize(pb.TokenizeRequest(prompt="The capital of France is", return_token_strs=True))
    assert list(over_grpc.token_ids) == counted["tokens"] and len(over_grpc.token_strs) == counted["count"]
    assert fp32_stack.stub.Detokenize(pb.DetokenizeRequest(token_ids=counted["tokens"])).text == text["prompt"]
    for path, body, param in (
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "wibble": 1}, "wibble"),
        ("/tokenize", {"messages": messages, "add_generation_prompt": False}, "add_generation_prompt"),
        ("/detokenize", {"tokens": [1, 49152]}, "tokens[1]"),
        ("/detokenize", {"tokens": "1"}, "tokens"),
    ):
        status, refused = call(fp32_stack, "POST", path, body)
        assert status == 400 and isinstance(refused, dict) and refused["error"]["param"] == param, (path, refused)
    with pytest.raises(grpc.RpcError) as caught:
        fp32_stack.stub.Detokenize(pb.DetokenizeRequest(token_ids=[49152]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids[0]" in str(caught.value.details())
