"""API keys on the public ports (gateway/access.py), through the real clients: the openai SDK, plain HTTP, gRPC.

A stack started with a key file and `--prefix-cache-scope tenant`: every route but the
probes' wants a key, a missing key and a wrong one get the same 401 / UNAUTHENTICATED, and
one key's requests never hit the prefix-cache pages another key's requests left.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import specserve_pb2 as pb
from specserve.stack import StackConfig
from tests.e2e.stack import Stack, collect, running_stack

MODEL = "SmolLM2-135M-Instruct"
KEYS = ("key-of-tenant-a", "key-of-tenant-b")
# A prompt of several pages, so that a second request of it finds them in the cache (or, for another tenant, not).
LONG_PROMPT = " ".join(f"Clause {i}: the parties agree to terms of the {i}th kind." for i in range(40))


@pytest.fixture(scope="module")
def keyed_stack(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("keyed_stack")
    key_file = folder / "api-keys"
    key_file.write_text("# one key a line\n" + "\n".join(KEYS) + "\n")
    config = StackConfig(default_model_dir, dtype="float32", num_workers=1, max_num_seqs=8, num_threads_per_worker=1,
                         api_key_file=key_file, prefix_cache_scope="tenant")
    with running_stack(config, folder) as stack:
        yield stack


def call(stack: Stack, method: str, path: str, body: dict[str, Any] | None = None,
         key: str | None = None) -> tuple[int, dict[str, str], Any]:
    connection = http.client.HTTPConnection("127.0.0.1", stack.addresses.http_port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        connection.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        answer = connection.getresponse()
        text = answer.read().decode()
        return answer.status, dict(answer.getheaders()), json.loads(text) if text.startswith(("{", "[")) else text
    finally:
        connection.close()


def test_every_route_but_the_probes_wants_a_key(keyed_stack: Stack) -> None:
    assert call(keyed_stack, "GET", "/health")[0] == 200
    assert call(keyed_stack, "GET", "/ready")[0] == 200
    completion = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    for key in (None, "not-a-key", KEYS[0] + "x", KEYS[0][:-1]):
        for method, path, body in (("POST", "/v1/completions", completion), ("GET", "/v1/models", None),
                                   ("GET", "/metrics", None), ("POST", "/generate", {"text": "Hi"}),
                                   ("GET", "/get_server_info", None)):
            status, headers, answer = call(keyed_stack, method, path, body, key)
            assert status == 401 and headers.get("WWW-Authenticate") == "Bearer", (path, key, answer)
            assert answer["error"]["code"] == "invalid_api_key" and KEYS[0] not in json.dumps(answer)
    status, _, answer = call(keyed_stack, "POST", "/v1/completions", completion, KEYS[1])
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
    status, _, answer = call(keyed_stack, "POST", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
                             KEYS[0])
    assert status == 200 and answer["meta_info"]["completion_tokens"] == 2, answer


def test_the_openai_sdk_with_a_wrong_key_gets_401(keyed_stack: Stack) -> None:
    # (The SDK sends no request without a key; a request with none is the raw HTTP test's.)
    base_url = f"http://127.0.0.1:{keyed_stack.addresses.http_port}/v1"
    for key in ("wrong", KEYS[0].upper()):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base_url, api_key=key, max_retries=0).completions.create(
                model=MODEL, prompt="Hello", max_tokens=2)
    reply = openai.OpenAI(base_url=base_url, api_key=KEYS[0]).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0)
    assert reply.usage is not None and reply.usage.completion_tokens == 3


def test_grpc_wants_the_key_in_its_metadata_and_health_stays_open(keyed_stack: Stack) -> None:
    request = pb.GenerateRequest(prompt="Hello", params=pb.SamplingParams(max_tokens=2))
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", KEYS[0]),)):
        with pytest.raises(grpc.RpcError) as caught:
            collect(keyed_stack.stub.Generate(request, timeout=30, metadata=metadata))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as caught:
            keyed_stack.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=30, metadata=metadata)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    keyed = (("authorization", f"Bearer {KEYS[1]}"),)
    assert len(collect(keyed_stack.stub.Generate(request, timeout=60, metadata=keyed)).token_ids) == 2
    assert keyed_stack.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=30, metadata=keyed).model_name
    health = health_pb2_grpc.HealthStub(keyed_stack.channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_one_tenants_prefix_cache_pages_are_never_another_tenants_hits(keyed_stack: Stack) -> None:
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 1}

    def cached(key: str, extra: dict[str, Any] | None = None) -> int:
        status, _, answer = call(keyed_stack, "POST", "/v1/completions", {**body, **(extra or {})}, key)
        assert status == 200, answer
        return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])

    cached(KEYS[0])
    assert cached(KEYS[0]) > 300  # the same tenant: its own pages
    assert cached(KEYS[1]) == 0  # another tenant: nothing, though the prompt is the same
    assert cached(KEYS[1]) > 300  # which now has pages of its own
    # A cache_salt divides a tenant's cache further, and one tenant cannot name another's salt to reach it.
    assert cached(KEYS[0], {"cache_salt": "team-1"}) == 0
    assert cached(KEYS[0], {"cache_salt": "team-1"}) > 300
    assert cached(KEYS[1], {"cache_salt": "team-1"}) == 0
