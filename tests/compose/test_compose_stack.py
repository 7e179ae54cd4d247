"""`docker compose up` on a CPU machine: the stack serves what `specserve up` serves, survives a worker crash without
losing a token, logs each request in every container it passes through, and `down` leaves nothing behind; started
again with TLS, client certificates and an API key, it serves the same over them.

The tests run in order on one stack (the file's order); the last but one takes it down, the last brings up its own.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from openai import AuthenticationError, DefaultHttpxClient, OpenAI

from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc
from specserve.health_probes import is_serving
from specserve.stack import free_ports
from tests.compose.conftest import Compose, print_logs_if_failed, progress
from tests.compose.images import ROOT, on_host_network
from tests.tls_certs import make_test_ca

# The first test's set-up builds the image (5 to 8 minutes on two cores) and starts `specserve up` and the stack.
pytestmark = pytest.mark.timeout(1800)

MODEL_NAME = "SmolLM2-135M-Instruct"
CHATS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "List three prime numbers.",
)
TEXTS = ("The quick brown fox", "def fibonacci(n):", "Once upon a time, in a land far away,")
LONG = (
    "Explain how a bicycle works.",
    "Describe the water cycle.",
    "Tell me about the history of Rome.",
    "How do airplanes fly?",
)  # streams long enough to be cut by a crash
MAX_TOKENS = 40
LONG_TOKENS = 160


def _greedy(max_tokens: int, ignore_eos: bool = False) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)


def _chat(text: str) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=text)])


@dataclass
class Outputs:
    """What one stack answered: gRPC token ids, the openai client's chat and completion texts."""

    grpc_chat: list[list[int]]
    grpc_text: list[list[int]]
    openai_chat: list[str]
    openai_text: list[str]
    long: list[list[int]]


def _stream(stub: pb_grpc.SpecServeStub, request: pb.GenerateRequest) -> list[int]:
    return [t for chunk in stub.Generate(request, timeout=600) for t in chunk.token_ids]


def _outputs(grpc_port: int, http_port: int) -> Outputs:
    client = OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0, timeout=300)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb_grpc.SpecServeStub(channel)
        return Outputs(
            grpc_chat=[
                _stream(stub, pb.GenerateRequest(chat=_chat(text), params=_greedy(MAX_TOKENS))) for text in CHATS
            ],
            grpc_text=[_stream(stub, pb.GenerateRequest(prompt=text, params=_greedy(MAX_TOKENS))) for text in TEXTS],
            openai_chat=[
                client.chat.completions.create(
                    model=MODEL_NAME,
                    messages=[{"role": "user", "content": text}],
                    temperature=0,
                    max_tokens=MAX_TOKENS,
                )
                .choices[0]
                .message.content
                or ""
                for text in CHATS
            ],
            openai_text=[
                client.completions.create(model=MODEL_NAME, prompt=text, temperature=0, max_tokens=MAX_TOKENS)
                .choices[0]
                .text
                for text in TEXTS
            ],
            long=[
                _stream(stub, pb.GenerateRequest(chat=_chat(text), params=_greedy(LONG_TOKENS, ignore_eos=True)))
                for text in LONG
            ],
        )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Outputs:
    """The same requests answered by `specserve up` on this machine, with its defaults (run first, alone)."""
    grpc_port, http_port = free_ports(2)
    log = (tmp_path_factory.mktemp("up") / "up.log").open("w")
    up = subprocess.Popen(
        [sys.executable, "-m", "specserve.cli", "up", "--port", str(grpc_port), "--http-port", str(http_port)],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    started = time.monotonic()
    try:
        while not is_serving("127.0.0.1", grpc_port):
            assert up.poll() is None, f"specserve up exited {up.returncode}: {Path(log.name).read_text()[-3000:]}"
            assert time.monotonic() - started < 600, "specserve up did not serve within 600 s"
            time.sleep(1)
        progress(f"specserve up serving in {time.monotonic() - started:.0f} s")
        return _outputs(grpc_port, http_port)
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=120)
        log.close()


@pytest.fixture(scope="module")
def stack(reference: Outputs, compose: Compose) -> Iterator[Compose]:
    """`docker-compose up -d`, then ready: /ready 200 and every container healthy."""
    started = time.monotonic()
    compose.compose("up", "-d", timeout_s=900)
    compose.wait_ready(timeout_s=900)
    compose.timings["up to ready"] = time.monotonic() - started
    progress(f"stack ready in {compose.timings['up to ready']:.0f} s")
    yield compose


@pytest.fixture(autouse=True)
def logs_on_failure(request: pytest.FixtureRequest, stack: Compose) -> Iterator[None]:
    yield
    print_logs_if_failed(request, stack)


def test_greedy_output_equals_specserve_up(stack: Compose, reference: Outputs) -> None:
    """Through gRPC and through the openai client, the containers answer token for token as `specserve up`."""
    assert _outputs(stack.grpc_port, stack.http_port) == reference


class Streams:
    """LONG's requests streamed at once from threads, each one's tokens kept as they come."""

    def __init__(self, stack: Compose, name: str) -> None:
        self.received: dict[int, list[int]] = {i: [] for i in range(len(LONG))}
        self.errors: list[BaseException] = []
        self._under_way = [threading.Event() for _ in LONG]
        self._threads = [
            threading.Thread(target=self._stream, args=(stack.grpc_port, f"compose-{name}-{i}", i))
            for i in range(len(LONG))
        ]
        for thread in self._threads:
            thread.start()

    def _stream(self, grpc_port: int, request_id: str, index: int) -> None:
        request = pb.GenerateRequest(
            chat=_chat(LONG[index]), params=_greedy(LONG_TOKENS, ignore_eos=True), request_id=request_id
        )
        try:
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                for chunk in pb_grpc.SpecServeStub(channel).Generate(request, timeout=900):
                    self.received[index].extend(chunk.token_ids)
                    if len(self.received[index]) >= 8:
                        self._under_way[index].set()
        except BaseException as error:  # noqa: BLE001 - reported by the test
            self.errors.append(error)
        finally:
            self._under_way[index].set()

    def wait_under_way(self) -> None:
        """Every stream has tokens and none has ended."""
        for event in self._under_way:
            assert event.wait(timeout=300), "a stream had no tokens within 300 s"
        assert not self.errors, self.errors
        assert all(len(tokens) < LONG_TOKENS for tokens in self.received.values()), "a stream ended before the kill"

    def finish(self) -> list[list[int]]:
        for thread in self._threads:
            thread.join(timeout=900)
        assert not self.errors, self.errors
        return [self.received[i] for i in range(len(LONG))]


def _hellos(stack: Compose) -> list[str]:
    """The worker ids of every hello the scheduler has had."""
    return [line["worker_id"] for line in _json_lines(stack.logs("scheduler")) if line["event"] == "worker.hello"]


def _restarted(inspected: dict, restarts_before: int) -> bool:  # type: ignore[type-arg]
    """The container was restarted and its new process runs."""
    return bool(inspected["RestartCount"] > restarts_before and inspected["State"]["Status"] == "running")


def test_a_worker_crash_mid_stream_restarts_it_and_every_request_completes(stack: Compose, reference: Outputs) -> None:
    """The worker container's process is killed (SIGKILL from the host, as the OOM killer would) while four streams
    run: restart: on-failure starts it again, its health is not taken from the status file the dead process left,
    it comes back as cpu-0, and every stream ends with exactly the tokens it would have had."""
    worker = stack.container("worker")
    restarts_before = stack.inspect(worker)["RestartCount"]
    streams = Streams(stack, "crash")
    streams.wait_under_way()
    pid = stack.inspect(worker)["State"]["Pid"]
    os.kill(pid, signal.SIGKILL)
    progress(f"killed the worker's process {pid} with {[len(t) for t in streams.received.values()]} tokens received")

    # Docker counts the restart, and says Running, from the moment it schedules it: the state is "restarting"
    # (Restarting and Running both true) until the new process runs. Only Status "running" means it does.
    deadline = time.monotonic() + 120
    while not _restarted(stack.inspect(worker), restarts_before):
        assert time.monotonic() < deadline, "the worker container was not restarted within 120 s"
        time.sleep(0.2)
    # Restarted, not yet READY: the file says READY (left by the killed process) or STARTING (the new one has
    # replaced it); either way the health check fails until the new process says READY itself.
    status = stack.docker("exec", worker, "cat", "/tmp/specserve.status").stdout.splitlines()[0]
    check = stack.docker(
        "exec", worker, "specserve", "healthcheck", "--status-file", "/tmp/specserve.status", check=False
    )
    progress(f"restarted: the status file says {status}, the health check {check.stdout.strip()!r}")
    assert check.returncode == 1 and "READY" not in check.stdout, check.stdout

    assert streams.finish() == reference.long
    stack.wait_ready(timeout_s=300)
    lost = [line["worker_id"] for line in _json_lines(stack.logs("scheduler")) if line["event"] == "worker.lost"]
    assert lost == ["cpu-0"]
    assert [w for w in _hellos(stack) if w.startswith("cpu-")] == ["cpu-0", "cpu-0"]  # its slot, and its id, back
    assert stack.inspect(worker)["RestartCount"] == restarts_before + 1  # the new process never exited


def test_docker_kill_mid_stream_loses_no_request_once_the_worker_is_started_again(
    stack: Compose, reference: Outputs
) -> None:
    """`docker kill` is a manual stop to Docker: the container stays down (no restart policy applies), the streams
    wait, and once `docker-compose up -d` starts it again every stream ends token-identical."""
    worker = stack.container("worker")
    streams = Streams(stack, "docker-kill")
    streams.wait_under_way()
    stack.docker("kill", worker)
    progress(f"docker kill of the worker with {[len(t) for t in streams.received.values()]} tokens received")
    time.sleep(5)
    assert not stack.inspect(worker)["State"]["Running"]
    assert all(len(tokens) < LONG_TOKENS for tokens in streams.received.values())  # waiting, not failed
    assert not streams.errors, streams.errors
    stack.compose("up", "-d", timeout_s=300)
    assert streams.finish() == reference.long
    stack.wait_ready(timeout_s=300)
    assert stack.containers("worker") == [worker]  # the same container, started again


def _json_lines(text: str) -> Iterator[dict]:  # type: ignore[type-arg]
    for line in text.splitlines():
        if line.startswith("{"):
            yield json.loads(line)


def test_one_request_is_logged_by_the_gateway_the_scheduler_and_the_worker(stack: Compose) -> None:
    request_id = f"compose-logs-{os.getpid()}"
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        tokens = _stream(
            pb_grpc.SpecServeStub(channel), pb.GenerateRequest(prompt="Hello", params=_greedy(8), request_id=request_id)
        )
    assert tokens
    # The gateway logs the client's id; its request.submitted line names the id the scheduler and the worker know.
    gateway_lines = [line for line in _json_lines(stack.logs("gateway")) if line.get("request_id") == request_id]
    assert gateway_lines, f"no JSON log line of {request_id} in the gateway container's logs"
    progress(f"gateway: {[line['event'] for line in gateway_lines]}")
    (scheduler_id,) = [line["scheduler_id"] for line in gateway_lines if line["event"] == "request.submitted"]
    for service in ("scheduler", "worker"):
        events = [line["event"] for line in _json_lines(stack.logs(service)) if line.get("request_id") == scheduler_id]
        assert events, f"no JSON log line of {scheduler_id} ({request_id}) in the {service} container's logs"
        progress(f"{service}: {events}")


def test_down_leaves_no_container_network_or_process(stack: Compose) -> None:
    stack.compose("down", "-v", timeout_s=300)
    assert stack.leftovers() == {"containers": [], "networks": []}
    processes = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    left = [line for line in processes.splitlines() if "/opt/specserve/" in line]
    assert not left, left


def test_tls_with_client_certificates_and_an_api_key_pass_through_compose(
    stack: Compose, reference: Outputs, tmp_path: Path
) -> None:
    """SPECSERVE_TLS_DIR, _CERTFILE, _KEYFILE, _CA_CERTFILE and SPECSERVE_API_KEY reach the gateway: its health check
    asks /ready over HTTPS (the container turns healthy), a client with the CA's certificate and the key gets what
    `specserve up` answered, through the openai client and gRPC; without a certificate or the key, it is refused."""
    key = "compose-test-key"
    ca = make_test_ca(tmp_path)
    env = {
        **stack.env,
        "SPECSERVE_TLS_DIR": str(tmp_path),
        "SPECSERVE_TLS_CERTFILE": f"/tls/{ca.server_cert.name}",
        "SPECSERVE_TLS_KEYFILE": f"/tls/{ca.server_key.name}",
        "SPECSERVE_TLS_CA_CERTFILE": f"/tls/{ca.ca_cert.name}",
        "SPECSERVE_API_KEY": key,
    }
    (tmp_path / "compose").mkdir()
    secured = Compose(
        env, on_host_network(env, tmp_path / "compose"), stack.grpc_port, stack.http_port, tls_ca=ca.ca_cert
    )
    started = time.monotonic()
    try:
        secured.compose("up", "-d", timeout_s=900)
        secured.wait_ready(timeout_s=900)
        progress(f"the stack with TLS ready in {time.monotonic() - started:.0f} s")
        certified = ssl.create_default_context(cafile=str(ca.ca_cert))
        certified.load_cert_chain(ca.client_cert, ca.client_key)
        client = OpenAI(
            base_url=f"https://localhost:{stack.http_port}/v1",
            api_key=key,
            max_retries=0,
            timeout=300,
            http_client=DefaultHttpxClient(verify=certified),
        )
        answer = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": CHATS[0]}], temperature=0, max_tokens=MAX_TOKENS
        )
        assert answer.choices[0].message.content == reference.openai_chat[0]
        with pytest.raises(AuthenticationError):  # the certificate is no key
            OpenAI(
                base_url=f"https://localhost:{stack.http_port}/v1",
                api_key="wrong",
                max_retries=0,
                http_client=DefaultHttpxClient(verify=certified),
            ).models.list()
        without = ssl.create_default_context(cafile=str(ca.ca_cert))
        with pytest.raises(AuthenticationError):  # the key is no certificate
            OpenAI(
                base_url=f"https://localhost:{stack.http_port}/v1",
                api_key=key,
                max_retries=0,
                http_client=DefaultHttpxClient(verify=without),
            ).models.list()
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca.ca_cert.read_bytes(),
            private_key=ca.client_key.read_bytes(),
            certificate_chain=ca.client_cert.read_bytes(),
        )
        with grpc.secure_channel(f"localhost:{stack.grpc_port}", credentials) as channel:
            stub = pb_grpc.SpecServeStub(channel)
            request = pb.GenerateRequest(chat=_chat(CHATS[0]), params=_greedy(MAX_TOKENS))
            tokens = [
                t
                for chunk in stub.Generate(request, timeout=600, metadata=(("authorization", f"Bearer {key}"),))
                for t in chunk.token_ids
            ]
            assert tokens == reference.grpc_chat[0]
            with pytest.raises(grpc.RpcError) as caught:
                _stream(stub, request)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        secured.compose("down", "-v", timeout_s=300, check=False)
    assert secured.leftovers() == {"containers": [], "networks": []}
