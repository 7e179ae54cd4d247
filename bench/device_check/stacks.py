"""The stacks the check serves: one started per session, a gRPC client of its gateway, and its parts run on it."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import grpc

from bench.device_check.report import Budget, Outcome, Report, Sizes, describe_error, run_part, skipped
from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc
from specserve.local_stack import LocalStack, StackError, running
from specserve.stack import free_ports
from specserve.up import UpRefused, add_up_arguments, up_config

STACK_START_S = 45.0  # what starting a stack takes at most on the device, for the budget
POLL_S = 0.05

V = TypeVar("V")


class Served:
    """A started stack and a gRPC client of its gateway."""

    def __init__(self, stack: LocalStack) -> None:
        self.stack = stack
        self.address = f"127.0.0.1:{stack.addresses.grpc_port}"
        self._channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.SpecServeStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def info(self) -> pb.ServerInfoResponse:
        reply: pb.ServerInfoResponse = self.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=10)
        return reply

    def process(self, process_id: str) -> pb.Process | None:
        """The scheduler's latest word on `process_id` (its newest incarnation)."""
        found = [p for p in self.info().processes if p.process_id == process_id]
        return found[-1] if found else None

    def generate(self, prompt_ids: list[int], num_tokens: int, timeout_s: float) -> list[int]:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt_ids),
            params=pb.SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True),
        )
        return [token for chunk in self.stub.Generate(request, timeout=timeout_s) for token in chunk.token_ids]

    def targets(self) -> list[dict[str, Any]]:
        return [
            {"process_id": p.process_id, "state": p.state, "graphs": p.graphs, "kernels": p.kernels}
            | ({"batch_invariant": p.batch_invariant} if p.HasField("batch_invariant") else {})
            for p in self.info().processes
            if p.role == "target"
        ]


@contextmanager
def serving(up_flags: Sequence[str], worker_args: Sequence[str], log_dir: Path, timeout_s: float) -> Iterator[Served]:
    """The stack `specserve up UP_FLAGS` runs, its workers given WORKER_ARGS besides, unsupervised (so that a part may
    kill and restart its processes); yielded once it serves, stopped on the way out."""
    parser = argparse.ArgumentParser(prog="specserve up")
    add_up_arguments(parser)
    try:
        config = up_config(parser.parse_args(list(up_flags)))
    except UpRefused as refusal:
        raise StackError(f"specserve up: {refusal}") from refusal
    log_dir.mkdir(parents=True, exist_ok=True)
    stack_config = replace(config.stack, worker_args=(*config.stack.worker_args, *worker_args))
    with running(LocalStack(stack_config, log_dir), timeout_s=timeout_s) as stack:
        served = Served(stack)
        try:
            yield served
        finally:
            served.close()


@dataclass(frozen=True)
class Part:
    name: str
    need_s: float  # what it takes at most on the device, stack excluded: less left skips it
    run: Callable[[Served], Outcome[None]]


@dataclass(frozen=True)
class Session:
    """One stack and the parts run on it, in order."""

    name: str
    flags: tuple[str, ...]
    parts: tuple[Part, ...]


def run_session(
    report: Report, budget: Budget, session: Session, sizes: Sizes, base_flags: Sequence[str], log_root: Path
) -> None:
    first = session.parts[0]
    if budget.left_s() < STACK_START_S + first.need_s:
        for part in session.parts:
            report.record(part.name, skipped(budget, STACK_START_S + part.need_s))
        return
    grpc_port, http_port = free_ports(2)
    flags = [*base_flags, *session.flags, "--port", str(grpc_port), "--http-port", str(http_port)]
    started = time.monotonic()
    try:
        timeout_s = min(180.0, budget.left_s())
        with serving(flags, sizes.worker_args, log_root / session.name, timeout_s) as served:
            report.stacks[session.name] = {
                "flags": flags,
                "start_s": round(time.monotonic() - started, 1),
                "targets": served.targets(),
            }
            for part in session.parts:
                run_part(report, budget, part.name, part.need_s, partial(part.run, served))
    except Exception as error:  # the stack did not start, or did not stop: its parts say so, the next stack runs
        report.stacks[session.name] = {"flags": flags, "error": describe_error(error)}
        for part in session.parts:
            if part.name not in report.parts:
                report.record(part.name, {"status": "error", "error": f"its stack {session.name} failed: {error}"})
    report.write()


def wait_for(what: str, timeout_s: float, probe: Callable[[], V | None]) -> V:
    deadline = time.monotonic() + timeout_s
    while (value := probe()) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(POLL_S)
    return value


def in_state(served: Served, process_id: str, states: tuple[str, ...]) -> Callable[[], pb.Process | None]:
    def probe() -> pb.Process | None:
        process = served.process(process_id)
        return process if process is not None and process.state in states else None

    return probe
