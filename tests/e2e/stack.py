"""A real specserve stack for tests: the launcher's LocalStack, with a gRPC client and the waits the tests need.

`Stack` subclasses LocalStack rather than wrapping it: a test reaches the processes
(`processes`, `log_dir`, `start_worker`, ...) and the client (`generate`, `info`, ...)
through one name, and the subclass adds only client calls.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import grpc
import zmq

from common.transport import Role, Transport
from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc
from proto.lifecycle import State
from specserve.local_stack import LocalStack, running
from specserve.stack import StackConfig


class Stack(LocalStack):
    def __init__(self, config: StackConfig, log_dir: Path) -> None:
        super().__init__(config, log_dir)
        self._channel: grpc.Channel | None = None

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
        super().stop()

    @property
    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(f"127.0.0.1:{self.addresses.grpc_port}")
        return self._channel

    @property
    def stub(self) -> pb_grpc.SpecServeStub:
        return pb_grpc.SpecServeStub(self.channel)

    def insider(self, context: zmq.Context[zmq.Socket[bytes]], role: Role) -> zmq.Socket[bytes]:
        """A DEALER connected to the scheduler's `role` socket holding this stack's key for that role: what a
        compromised process (or one with a stolen key) can send,
        the checks behind the handshake being what is tested."""
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        Transport(self.config.keys).join(sock, role)
        sock.connect(self.addresses.gateway_address if role == "gateway" else self.addresses.worker_address)
        return sock

    def info(self) -> pb.ServerInfoResponse:
        reply: pb.ServerInfoResponse = self.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=5)
        return reply

    def process_info(self, process_id: str) -> pb.Process | None:
        return next((p for p in self.info().processes if p.process_id == process_id), None)

    def wait_process_state(self, process_id: str, state: str, timeout_s: float = 120.0) -> pb.Process:
        deadline = time.monotonic() + timeout_s
        while True:
            found = [p for p in self.info().processes if p.process_id == process_id]
            if found and found[-1].state == state:
                return found[-1]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{process_id} is not {state} after {timeout_s} s: {found}\n{self.logs()}")
            time.sleep(0.1)

    def wait_reachable(self, timeout_s: float = 60.0) -> None:
        """Wait until the gateway answers GetServerInfo (it may still be NOT_SERVING)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.info()
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def wait_idle(self, timeout_s: float = 30.0) -> pb.ServerInfoResponse:
        """Wait until no request runs or waits and no sequence holds a KV page (the prefix cache may keep some)."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.info()
            live = [p for p in info.processes if p.state == State.READY]
            if (
                info.num_running == 0
                and info.num_waiting == 0
                and all(p.num_used_kv_pages == p.num_cached_kv_pages and p.num_running == 0 for p in live)
            ):
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"the stack is not idle after {timeout_s} s: {info}")
            time.sleep(0.1)

    def generate(self, request: pb.GenerateRequest, timeout_s: float = 120) -> GenerateResult:
        return collect(self.stub.Generate(request, timeout=timeout_s))


@dataclass
class GenerateResult:
    token_ids: list[int]
    text: str
    finish_reason: int
    prompt_tokens: int
    completion_tokens: int
    num_chunks: int
    cached_tokens: int = 0
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # when asked: (logprob, [(token, logprob)])


def collect(stream: Iterator[pb.GenerateResponse]) -> GenerateResult:
    token_ids: list[int] = []
    text: list[str] = []
    last: pb.GenerateResponse | None = None
    num_chunks = 0
    logprobs: list[tuple[float, list[tuple[int, float]]]] = []
    for chunk in stream:
        token_ids.extend(chunk.token_ids)
        logprobs.extend((e.logprob, [(t.token_id, t.logprob) for t in e.top_logprobs]) for e in chunk.logprobs)
        text.append(chunk.text)
        last = chunk
        num_chunks += 1
    assert last is not None, "the stream ended without a chunk"
    return GenerateResult(
        token_ids,
        "".join(text),
        last.finish_reason,
        last.usage.prompt_tokens,
        last.usage.completion_tokens,
        num_chunks,
        last.usage.cached_tokens,
        logprobs or None,
    )


def running_stack(config: StackConfig, log_dir: Path) -> AbstractContextManager[Stack]:
    """A started, serving stack, stopped on the way out whatever happened."""
    return running(Stack(config, log_dir))
