"""A real specserve stack for tests: scheduler, workers and gateway as separate processes on free ports."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.faults import ENV_VAR
from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class StackOptions:
    model: Path
    dtype: str = "float32"
    num_workers: int = 1
    num_kv_slots: int = 16
    max_model_len: int = 2048
    max_num_batched_tokens: int = 256
    scheduler_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)
    draft: str | None = None  # a draft service's --proposer; None: no draft service
    draft_args: list[str] = field(default_factory=list)


class Stack:
    def __init__(self, options: StackOptions, log_dir: Path) -> None:
        self.options = options
        self.log_dir = log_dir
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.gateway_address = f"tcp://127.0.0.1:{free_port()}"
        self.worker_address = f"tcp://127.0.0.1:{free_port()}"
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._channel: grpc.Channel | None = None

    # ------------------------------------------------------------------ processes

    def start(self, wait_serving: bool = True) -> Stack:
        o = self.options
        self.spawn("scheduler", ["scheduler", "--gateway-address", self.gateway_address, "--worker-address", self.worker_address,
                                 "--model-name", o.model.name, "--max-model-len", str(o.max_model_len),
                                 "--max-num-batched-tokens", str(o.max_num_batched_tokens), *o.scheduler_args])
        for i in range(o.num_workers):
            self.start_worker(i)
        if o.draft is not None:
            self.start_draft()
        self.spawn("gateway", ["gateway", "--model", str(o.model), "--scheduler-address", self.gateway_address,
                               "--host", "127.0.0.1", "--port", str(self.grpc_port), "--http-port", str(self.http_port)])
        if wait_serving:
            self.wait_serving()
        return self

    def start_worker(self, index: int | str, extra: list[str] | None = None, fault: str | None = None) -> None:
        """Start worker `index` (its id is worker-INDEX); `fault` sets SPECSERVE_FAULT for it alone."""
        o = self.options
        threads = "1" if o.num_workers > 1 else "0"
        self.spawn(f"worker-{index}", ["gpu_worker", "--worker-id", f"worker-{index}", "--model", str(o.model),
                                       "--scheduler-address", self.worker_address, "--dtype", o.dtype,
                                       "--max-model-len", str(o.max_model_len), "--num-kv-slots", str(o.num_kv_slots),
                                       "--max-num-batched-tokens", str(o.max_num_batched_tokens), "--num-threads", threads,
                                       *o.worker_args, *(extra or [])], fault=fault)

    def start_draft(self, fault: str | None = None) -> None:
        o = self.options
        assert o.draft is not None
        self.spawn("draft", ["draft_service", "--worker-id", "draft-0", "--proposer", o.draft,
                             "--scheduler-address", self.worker_address, "--dtype", o.dtype,
                             "--max-model-len", str(o.max_model_len), "--num-seqs", str(o.num_kv_slots * o.num_workers),
                             "--num-threads", "1", *o.draft_args], fault=fault)

    def wait_process_state(self, process_id: str, state: str, timeout_s: float = 120.0) -> pb.Process:
        deadline = time.monotonic() + timeout_s
        while True:
            found = [p for p in self.info().processes if p.process_id == process_id]
            if found and found[-1].state == state:
                return found[-1]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{process_id} is not {state} after {timeout_s} s: {found}\n{self.logs()}")
            time.sleep(0.1)

    def spawn(self, name: str, module_argv: list[str], fault: str | None = None) -> None:
        log = (self.log_dir / f"{name}.log").open("ab")
        env = {**os.environ, ENV_VAR: fault} if fault else None
        self.processes[name] = subprocess.Popen([sys.executable, "-m", *module_argv], stdout=log, stderr=subprocess.STDOUT, env=env)

    def process_info(self, process_id: str) -> pb.Process | None:
        return next((p for p in self.info().processes if p.process_id == process_id), None)

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
        for name in sorted(self.processes, key=lambda n: n != "gateway"):
            process = self.processes[name]
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def logs(self) -> str:
        return "\n".join(f"===== {p.name}\n{p.read_text()[-4000:]}" for p in sorted(self.log_dir.glob("*.log")))

    # ------------------------------------------------------------------ API

    @property
    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        return self._channel

    @property
    def stub(self) -> pb_grpc.SpecServeStub:
        return pb_grpc.SpecServeStub(self.channel)

    def health(self) -> int:
        try:
            reply = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        except grpc.RpcError:
            return health_pb2.HealthCheckResponse.UNKNOWN
        status: int = reply.status
        return status

    def wait_serving(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.health() != health_pb2.HealthCheckResponse.SERVING:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the stack did not become SERVING in {timeout_s} s\n{self.logs()}")
            time.sleep(0.2)

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

    def info(self) -> pb.ServerInfoResponse:
        reply: pb.ServerInfoResponse = self.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=5)
        return reply

    def wait_idle(self, timeout_s: float = 30.0) -> pb.ServerInfoResponse:
        """Wait until no request runs or waits and every live worker reports all KV slots free."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.info()
            live = [p for p in info.processes if p.state == "READY"]
            if info.num_running == 0 and info.num_waiting == 0 and all(p.num_used_kv_slots == 0 and p.num_running == 0 for p in live):
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


def collect(stream: Iterator[pb.GenerateResponse]) -> GenerateResult:
    token_ids: list[int] = []
    text: list[str] = []
    last: pb.GenerateResponse | None = None
    num_chunks = 0
    for chunk in stream:
        token_ids.extend(chunk.token_ids)
        text.append(chunk.text)
        last = chunk
        num_chunks += 1
    assert last is not None, "the stream ended without a chunk"
    return GenerateResult(token_ids, "".join(text), last.finish_reason, last.usage.prompt_tokens,
                          last.usage.completion_tokens, num_chunks)


@contextmanager
def running_stack(options: StackOptions, log_dir: Path) -> Iterator[Stack]:
    """A started stack, stopped on the way out whatever happened."""
    stack = Stack(options, log_dir)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()
