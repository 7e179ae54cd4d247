"""`specserve up` starts the whole stack and prints one ready line; `generate` talks to it;
Ctrl-C leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc
from specserve.stack import free_port, free_ports

SPECSERVE = [sys.executable, "-m", "specserve.cli"]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _process(port: int, process_id: str) -> pb.Process | None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        info = pb_grpc.SpecServeStub(channel).GetServerInfo(pb.ServerInfoRequest(), timeout=5)
    return next((p for p in info.processes if p.process_id == process_id), None)


def _all_ready(port: int) -> bool:
    """Both target workers and the draft service READY, as the (restarted) scheduler sees them."""
    try:
        return all(
            (p := _process(port, name)) is not None and p.state == "READY"
            for name in ("worker-0", "worker-1", "draft-0")
        )
    except grpc.RpcError:  # no scheduler behind the gateway yet
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().split()
    except FileNotFoundError:  # reaped since
        return False
    return stat[2] != "Z"


def test_up_generate_and_ctrl_c(default_model_dir: Path) -> None:
    port, http_port = free_ports(2)
    up = subprocess.Popen(
        [
            *SPECSERVE,
            "up",
            "--model",
            str(default_model_dir),
            "--dtype",
            "float32",
            "--port",
            str(port),
            "--http-port",
            str(http_port),
            "--max-num-seqs",
            "4",
            "--kv-cache-memory",
            "0.25",
            "--num-workers",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert up.stdout is not None
        ready_line = up.stdout.readline()  # blocks until the stack is ready (or up exits)
        assert ready_line.startswith("specserve ready: gRPC on 127.0.0.1:"), ready_line
        assert "(float32, weights q4_1, 2 worker(s) on cpu)" in ready_line  # its own 4-bit blocks, by default
        children = _children(up.pid)
        assert len(children) == 5  # scheduler, gateway, two workers, the draft service (lookup, then the shipped head)

        out = subprocess.run(
            [
                *SPECSERVE,
                "generate",
                "--address",
                f"127.0.0.1:{port}",
                "--chat",
                "Say hello.",
                "--max-tokens",
                "8",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        result = json.loads(out.stdout)
        assert set(result) >= {"token_ids", "text", "finish_reason", "usage"}
        assert 1 <= len(result["token_ids"]) <= 8 and result["usage"]["completion_tokens"] == len(result["token_ids"])
        assert result["usage"]["accepted_draft_tokens"] <= result["usage"]["draft_tokens"]

        streamed = subprocess.run(
            [
                *SPECSERVE,
                "generate",
                "--address",
                f"127.0.0.1:{port}",
                "--prompt",
                "Once upon a time",
                "--max-tokens",
                "8",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert streamed.stdout.strip()

        # A worker killed with SIGKILL is restarted by the supervisor and comes back READY as a new incarnation.
        (victim,) = [pid for pid in children if "--worker-id\0worker-1\0" in _cmdline(pid)]
        before = _process(port, "worker-1")
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while (
            (now := _process(port, "worker-1")) is None or now.incarnation == before.incarnation or now.state != "READY"
        ):
            assert time.monotonic() < deadline, f"worker-1 did not come back: {now}"
            time.sleep(0.2)
        children = _children(up.pid)
        assert len(children) == 5 and victim not in children

        # The scheduler killed while a request streams: the supervisor restarts it, the workers and the draft
        # service that knew the old one exit to register anew, and the gateway resumes the request from the tokens
        # it had: the client sees one stream with the very tokens of an undisturbed run.
        request = pb.GenerateRequest(
            prompt="The history of the Roman empire",
            params=pb.SamplingParams(max_tokens=96, temperature=0, ignore_eos=True),
        )
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            undisturbed = [
                t for r in pb_grpc.SpecServeStub(channel).Generate(request, timeout=120) for t in r.token_ids
            ]
            call = pb_grpc.SpecServeStub(channel).Generate(request, timeout=180)
            first = [next(call) for _ in range(3)]
            assert first[-1].finish_reason == pb.FINISH_REASON_UNSPECIFIED  # still streaming when the scheduler dies
            (scheduler,) = [pid for pid in children if "-m\0scheduler\0" in _cmdline(pid)]
            os.kill(scheduler, signal.SIGKILL)
            rest = list(call)
        assert [t for r in [*first, *rest] for t in r.token_ids] == undisturbed
        assert rest[-1].usage.completion_tokens == len(undisturbed)
        deadline = time.monotonic() + 120
        while len(children := _children(up.pid)) != 5 or scheduler in children or not _all_ready(port):
            assert time.monotonic() < deadline, "the stack did not come back after the scheduler was killed"
            time.sleep(0.5)

        # Killed twice within 5 s while four requests stream (the second scheduler dies young too): every stream
        # waits for the third and completes with the tokens of an undisturbed run.
        requests = [
            pb.GenerateRequest(
                prompt=f"Chapter {i}. The river",
                params=pb.SamplingParams(max_tokens=64, temperature=0, ignore_eos=True),
            )
            for i in range(4)
        ]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.SpecServeStub(channel)
            undisturbed_all = [[t for r in stub.Generate(q, timeout=120) for t in r.token_ids] for q in requests]
            calls = [stub.Generate(q, timeout=300) for q in requests]
            firsts = [[next(c)] for c in calls]
            killed_at = time.monotonic()
            first_victim = _scheduler_pid(up.pid)
            os.kill(first_victim, signal.SIGKILL)
            while (second_victim := _scheduler_pid(up.pid)) in (None, first_victim):
                assert time.monotonic() - killed_at < 4.0, "the supervisor did not restart the scheduler"
                time.sleep(0.05)
            time.sleep(0.3)
            os.kill(second_victim, signal.SIGKILL)
            assert time.monotonic() - killed_at < 5.0
            streams = [[t for r in [*head, *call] for t in r.token_ids] for head, call in zip(firsts, calls)]
        assert streams == undisturbed_all

        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if _alive(pid)], "a service outlived `specserve up`"
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def _scheduler_pid(up_pid: int) -> int | None:
    return next((pid for pid in _children(up_pid) if "-m\0scheduler\0" in _cmdline(pid)), None)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:  # gone meanwhile
        return ""


def test_generate_without_a_server_fails_clearly() -> None:
    out = subprocess.run(
        [*SPECSERVE, "generate", "--address", f"127.0.0.1:{free_port()}", "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert out.stderr.startswith("error: UNAVAILABLE")
