"""The public ports' edges through the real clients (the openai SDK, plain HTTP, gRPC): API keys (gateway/access.py)
and TLS (gateway/tls.py).

A stack started with a key file and `--prefix-cache-scope tenant`: every route but the
probes' wants a key, a missing key and a wrong one get the same 401 / UNAUTHENTICATED, and
one key's requests never hit the prefix-cache pages another key's requests left. Beside its
own gateway, gateways with a test CA's certificate serve HTTPS and gRPC over TLS, one of
them wanting client certificates (mutual TLS).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ssl
import time
import urllib.error
import urllib.request
from dataclasses import replace

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc
from specserve.stack import StackConfig, free_ports, gateway_spec
from tests.e2e.stack import Stack, collect, running_stack
from tests.tls_certs import CertFiles, make_test_ca

MODEL = "SmolLM2-135M-Instruct"
KEYS = ("key-of-tenant-a", "key-of-tenant-b")
# A prompt of several pages, so that a second request of it finds them in the cache (or, for another tenant, not).
LONG_PROMPT = " ".join(f"Clause {i}: the parties agree to terms of the {i}th kind." for i in range(40))


@pytest.fixture(scope="module")
def keyed_stack(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("keyed_stack")
    key_file = folder / "api-keys"
    key_file.write_text("# one key a line\n" + "\n".join(KEYS) + "\n")
    config = StackConfig(
        default_model_dir,
        dtype="float32",
        num_workers=1,
        max_num_seqs=8,
        num_threads_per_worker=1,
        api_key_file=key_file,
        prefix_cache_scope="tenant",
    )
    with running_stack(config, folder) as stack:
        yield stack


def call(
    stack: Stack, method: str, path: str, body: dict[str, Any] | None = None, key: str | None = None
) -> tuple[int, dict[str, str], Any]:
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
        for method, path, body in (
            ("POST", "/v1/completions", completion),
            ("GET", "/v1/models", None),
            ("GET", "/metrics", None),
            ("POST", "/generate", {"text": "Hi"}),
            ("GET", "/get_server_info", None),
            ("POST", "/tokenize", {"prompt": "Hi"}),
        ):
            status, headers, answer = call(keyed_stack, method, path, body, key)
            assert status == 401 and headers.get("WWW-Authenticate") == "Bearer", (path, key, answer)
            assert answer["error"]["code"] == "invalid_api_key" and KEYS[0] not in json.dumps(answer)
    status, _, answer = call(keyed_stack, "POST", "/v1/completions", completion, KEYS[1])
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
    status, _, answer = call(
        keyed_stack, "POST", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}, KEYS[0]
    )
    assert status == 200 and answer["meta_info"]["completion_tokens"] == 2, answer


def test_the_openai_sdk_with_a_wrong_key_gets_401(keyed_stack: Stack) -> None:
    # (The SDK sends no request without a key; a request with none is the raw HTTP test's.)
    base_url = f"http://127.0.0.1:{keyed_stack.addresses.http_port}/v1"
    for key in ("wrong", KEYS[0].upper()):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base_url, api_key=key, max_retries=0).completions.create(
                model=MODEL, prompt="Hello", max_tokens=2
            )
    reply = openai.OpenAI(base_url=base_url, api_key=KEYS[0]).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
    )
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
        with pytest.raises(grpc.RpcError) as caught:
            keyed_stack.stub.Tokenize(pb.TokenizeRequest(prompt="Hi"), timeout=30, metadata=metadata)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    keyed = (("authorization", f"Bearer {KEYS[1]}"),)
    assert len(collect(keyed_stack.stub.Generate(request, timeout=60, metadata=keyed)).token_ids) == 2
    assert keyed_stack.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=30, metadata=keyed).model_name
    health = health_pb2_grpc.HealthStub(keyed_stack.channel).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=10
    )
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


# ---------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def test_ca(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    return make_test_ca(tmp_path_factory.mktemp("test_ca"))


def start_tls_gateway(stack: Stack, name: str, ca: CertFiles, *, mutual: bool) -> tuple[int, int]:
    """A gateway beside the stack's own, serving the test CA's server certificate on both ports (and with `mutual`,
    wanting client certificates the CA signed); its (gRPC, HTTP) ports once its health says SERVING over TLS."""
    grpc_port, http_port = free_ports(2, taken=(stack.addresses.grpc_port, stack.addresses.http_port))
    spec = gateway_spec(stack.config, replace(stack.addresses, grpc_port=grpc_port, http_port=http_port))
    tls = ["--tls-certfile", str(ca.server_cert), "--tls-keyfile", str(ca.server_key)]
    stack.spawn(
        replace(spec, name=name, argv=[*spec.argv, *tls, *(["--tls-ca-certfile", str(ca.ca_cert)] if mutual else [])])
    )
    credentials = grpc_credentials(ca, client=mutual)
    deadline = time.monotonic() + 60
    while True:
        try:
            with grpc.secure_channel(f"127.0.0.1:{grpc_port}", credentials) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return grpc_port, http_port
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, (stack.log_dir / f"{name}.log").read_text()[-3000:]
        time.sleep(0.2)


def grpc_credentials(ca: CertFiles, *, client: bool) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=ca.ca_cert.read_bytes(),
        private_key=ca.client_key.read_bytes() if client else None,
        certificate_chain=ca.client_cert.read_bytes() if client else None,
    )


def test_both_ports_serve_tls_to_clients_that_trust_the_ca(keyed_stack: Stack, test_ca: CertFiles) -> None:
    grpc_port, http_port = start_tls_gateway(keyed_stack, "gateway-tls", test_ca, mutual=False)
    api = openai.OpenAI(
        base_url=f"https://localhost:{http_port}/v1",
        api_key=KEYS[0],
        http_client=openai.DefaultHttpx2Client(verify=ssl.create_default_context(cafile=str(test_ca.ca_cert))),
    )
    reply = api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0)
    plain = call(
        keyed_stack,
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0},
        KEYS[0],
    )[2]
    assert reply.choices[0].text == plain["choices"][0]["text"]
    with pytest.raises(openai.APIConnectionError):  # a client that does not trust the CA never gets that far
        openai.OpenAI(base_url=f"https://localhost:{http_port}/v1", api_key=KEYS[0], max_retries=0).models.list()
    with pytest.raises((ConnectionError, http.client.HTTPException)):  # plain HTTP on a TLS port
        call_port(http_port, "/health")
    with grpc.secure_channel(f"127.0.0.1:{grpc_port}", grpc_credentials(test_ca, client=False)) as channel:
        stub = pb_grpc.SpecServeStub(channel)
        request = pb.GenerateRequest(prompt="Once upon a time", params=pb.SamplingParams(max_tokens=4))
        result = collect(stub.Generate(request, timeout=60, metadata=(("authorization", f"Bearer {KEYS[0]}"),)))
        assert result.text == plain["choices"][0]["text"]
        with pytest.raises(grpc.RpcError) as caught:  # TLS is no key: the key is still wanted
            collect(stub.Generate(request, timeout=60))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_with_a_client_ca_only_the_probes_take_a_connection_without_a_client_certificate(
    keyed_stack: Stack, test_ca: CertFiles, tmp_path: Path
) -> None:
    """Mutual TLS: the HTTP port gives a connection without a client certificate its probes' routes and a 401
    elsewhere, refuses a certificate another CA signed in the handshake, and serves one the client CA signed; the gRPC
    port refuses a connection without one in the handshake."""
    grpc_port, http_port = start_tls_gateway(keyed_stack, "gateway-mtls", test_ca, mutual=True)
    trusting = ssl.create_default_context(cafile=str(test_ca.ca_cert))
    for probe in ("/health", "/ready"):
        with urllib.request.urlopen(f"https://localhost:{http_port}{probe}", context=trusting, timeout=10) as answer:
            assert answer.status == 200
    without = openai.OpenAI(
        base_url=f"https://localhost:{http_port}/v1",
        api_key=KEYS[0],
        max_retries=0,
        http_client=openai.DefaultHttpx2Client(verify=trusting),
    )
    with pytest.raises(openai.AuthenticationError) as refused:  # the right key is no certificate
        without.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert refused.value.code == "client_certificate_required"
    stranger = make_test_ca(tmp_path)  # a client certificate signed by a CA the gateway does not know
    foreign = ssl.create_default_context(cafile=str(test_ca.ca_cert))
    foreign.load_cert_chain(stranger.client_cert, stranger.client_key)
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        urllib.request.urlopen(f"https://localhost:{http_port}/health", context=foreign, timeout=10)
    with_certificate = ssl.create_default_context(cafile=str(test_ca.ca_cert))
    with_certificate.load_cert_chain(test_ca.client_cert, test_ca.client_key)
    certified = openai.OpenAI(
        base_url=f"https://localhost:{http_port}/v1",
        api_key=KEYS[0],
        max_retries=0,
        http_client=openai.DefaultHttpx2Client(verify=with_certificate),
    )
    assert certified.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    request = pb.GenerateRequest(prompt="Hi", params=pb.SamplingParams(max_tokens=2))
    keyed = (("authorization", f"Bearer {KEYS[1]}"),)
    with grpc.secure_channel(f"127.0.0.1:{grpc_port}", grpc_credentials(test_ca, client=False)) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            collect(pb_grpc.SpecServeStub(channel).Generate(request, timeout=10, metadata=keyed))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake failed: no call was made
    with grpc.secure_channel(f"127.0.0.1:{grpc_port}", grpc_credentials(test_ca, client=True)) as channel:
        assert len(collect(pb_grpc.SpecServeStub(channel).Generate(request, timeout=60, metadata=keyed)).token_ids) == 2


def call_port(port: int, path: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    finally:
        connection.close()


def test_a_stack_started_with_mutual_tls_serves_over_it_and_knows_when_it_does(
    default_model_dir: Path, test_ca: CertFiles, tmp_path: Path
) -> None:
    """The launcher `specserve up` uses hands the TLS files and the client CA to the gateway, and its readiness probe
    speaks TLS without a client certificate (the probes' routes take none)."""
    config = StackConfig(
        default_model_dir,
        dtype="float32",
        num_workers=1,
        max_num_seqs=4,
        num_threads_per_worker=1,
        tls_certfile=test_ca.server_cert,
        tls_keyfile=test_ca.server_key,
        tls_ca_certfile=test_ca.ca_cert,
    )
    with running_stack(config, tmp_path) as stack:
        body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2}).encode()
        url = f"https://localhost:{stack.addresses.http_port}/v1/completions"
        context = ssl.create_default_context(cafile=str(test_ca.ca_cert))
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(
                urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}),
                context=context,
                timeout=60,
            )
        assert refused.value.code == 401
        context.load_cert_chain(test_ca.client_cert, test_ca.client_key)
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, context=context, timeout=60) as answer:
            assert json.loads(answer.read())["usage"]["completion_tokens"] == 2
