"""The public APIs fuzzed on a real stack (tests/fuzz_requests.py): OpenAI's completions and chat, SGLang's /generate
and gRPC's Generate answer every request within a time bound with a 200 or a 4xx (gRPC: OK or a client's error), in
JSON a strict parser reads, and the stack serves on; the attack run's requests are 400s naming their field; extreme
repetition penalties and grammar-masked alternatives give finite log-probabilities."""

from __future__ import annotations

import http.client
import json
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.openai_logprobs import LOGPROB_FLOOR
from proto import specserve_pb2 as pb
from tests.e2e.stack import Stack
from tests.fuzz_requests import (
    ATTACKS,
    CLIENT_ERRORS,
    answer_problem,
    body_text,
    chat_bodies,
    completions_bodies,
    deep_schema,
    grpc_requests,
    sglang_bodies,
    strict_json,
)

REPLY_TIMEOUT_S = 60.0  # a few tokens on a busy 2-core machine take well under a second: past this it is a hang
FUZZ = settings(
    max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)


def post(stack: Stack, path: str, text: str) -> tuple[int, str, str]:
    """Status, content type and body text; raises TimeoutError past REPLY_TIMEOUT_S."""
    connection = http.client.HTTPConnection("127.0.0.1", stack.addresses.http_port, timeout=REPLY_TIMEOUT_S)
    try:
        connection.request("POST", path, body=text.encode(), headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type") or "", response.read().decode()
    finally:
        connection.close()


@pytest.mark.parametrize(
    ("path", "bodies"),
    [
        ("/v1/completions", completions_bodies()),
        ("/v1/chat/completions", chat_bodies()),
        ("/generate", sglang_bodies()),
    ],
    ids=["completions", "chat", "sglang"],
)
def test_fuzzed_http_requests_are_answered_200_or_4xx_in_strict_json(
    fp32_stack: Stack, path: str, bodies: st.SearchStrategy[dict[str, Any]]
) -> None:
    @FUZZ
    @given(bodies)
    def one(body: dict[str, Any]) -> None:
        assert answer_problem(*post(fp32_stack, path, body_text(body))) == "", body

    one()
    status, _, text = post(
        fp32_stack, "/v1/completions", json.dumps({"prompt": "The capital of France is", "max_tokens": 2})
    )
    assert status == 200 and strict_json(text)["choices"][0]["finish_reason"] in ("length", "stop")


def test_fuzzed_grpc_requests_are_answered_ok_or_a_clients_error(fp32_stack: Stack) -> None:
    @FUZZ
    @given(grpc_requests())
    def one(request: pb.GenerateRequest) -> None:
        try:
            for _ in fp32_stack.stub.Generate(request, timeout=REPLY_TIMEOUT_S):
                pass
        except grpc.RpcError as error:
            assert error.code() in CLIENT_ERRORS, (error.code(), error.details(), request)

    one()


def test_the_attack_runs_requests_are_400_naming_the_field(fp32_stack: Stack) -> None:
    for path, body, field in ATTACKS:
        status, _, text = post(fp32_stack, path, body_text(body))
        assert status == 400 and strict_json(text)["error"]["param"] == field, (body, text)
    status, _, text = post(fp32_stack, "/v1/completions", '{"prompt": "hi", "seed": ' + "1" * 5000 + "}")
    assert status == 400 and "4300 digits" in text
    with pytest.raises(grpc.RpcError) as refused:
        fp32_stack.generate(
            pb.GenerateRequest(
                prompt="hi",
                params=pb.SamplingParams(
                    max_tokens=2, structured_output=pb.StructuredOutput(json_schema="[" * 30_000 + "]" * 30_000)
                ),
            )
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (refused.value.details() or "").startswith("params.structured_output.json_schema: ")


@pytest.mark.parametrize(
    "extra",
    [
        {"repetition_penalty": 0.01},
        {"repetition_penalty": 100},
        {"guided_choice": [" yes", " no"], "temperature": 0, "max_tokens": 4},
        {"guided_json": json.dumps(deep_schema(40)), "max_tokens": 6},
    ],
    ids=["least-repetition", "most-repetition", "grammar", "deep-schema"],
)
def test_log_probabilities_are_finite_at_the_extremes(fp32_stack: Stack, extra: dict[str, Any]) -> None:
    body = {"prompt": "Is it so? It is so, so so so", "max_tokens": 3, "logprobs": 20, "echo": True, **extra}
    status, content_type, text = post(fp32_stack, "/v1/completions", json.dumps(body))
    assert status == 200 and answer_problem(status, content_type, text) == "", text
    if "guided_choice" in extra:  # past the choice only eos is allowed: every alternative is -inf, written as the floor
        assert strict_json(text)["choices"][0]["finish_reason"] == "stop" and f"{LOGPROB_FLOOR}" in text, text
    sglang = {
        "text": body["prompt"],
        "sampling_params": {
            "max_new_tokens": 3,
            **{key: value for key, value in extra.items() if key == "repetition_penalty"},
        },
        "return_logprob": True,
        "top_logprobs_num": 20,
        "logprob_start_len": 0,
    }
    status, content_type, text = post(fp32_stack, "/generate", json.dumps(sglang))
    assert status == 200 and answer_problem(status, content_type, text) == "", text
