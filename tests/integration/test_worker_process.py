"""A real worker process driven over a real ZeroMQ socket by the test acting as its scheduler.

It must announce itself, report every start-up phase in order, refuse any step that
arrives before it is READY (never running it later), run steps once READY, and refuse
an inconsistent step without changing its state.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from common.lifecycle_process import EXIT_DISMISSED
from proto import messages as m
from specserve.stack import free_port

GREEDY = m.SamplingParams()


class FakeScheduler:
    def __init__(self) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.socket.bind(self.address)
        self.codec: m.Codec[m.WorkerToScheduler] = m.Codec(m.WorkerToScheduler)
        self.identity = b""

    def receive(self, kind: type, timeout_s: float = 120.0) -> msgspec.Struct:
        """The next message of `kind` from the worker's main socket (heartbeats skipped)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.socket.poll(100):
                identity, frame = self.socket.recv_multipart()
                message = self.codec.decode(frame)
                if isinstance(message, m.Heartbeat):
                    continue
                if isinstance(message, m.WorkerHello):  # a new process: its own identity
                    self.identity = identity
                self.identity = self.identity or identity
                if isinstance(message, kind):
                    return message
                if isinstance(message, m.WorkerFailed):
                    raise AssertionError(f"the worker failed: {message}")
        raise TimeoutError(f"no {kind.__name__} within {timeout_s} s")

    def send(self, message: msgspec.Struct) -> None:
        self.socket.send_multipart([self.identity, self.codec.encode(message)])

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()


@pytest.fixture
def scheduler() -> Iterator[FakeScheduler]:
    fake = FakeScheduler()
    yield fake
    fake.close()


def _start_worker(
    model: Path, address: str, tmp_path: Path, env: dict[str, str] | None = None, args: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    log = (tmp_path / "worker.log").open("wb")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpu_worker",
            "--model",
            str(model),
            "--scheduler-address",
            address,
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "0.01",
            "--max-model-len",
            "256",
            "--max-num-batched-tokens",
            "64",
            "--status-file",
            str(tmp_path / "status"),
            "--insecure-loopback",
            *args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )


def test_phases_refusal_before_ready_and_steps_after(
    default_model_dir: Path, scheduler: FakeScheduler, tmp_path: Path
) -> None:
    worker = _start_worker(default_model_dir, scheduler.address, tmp_path)
    try:
        hello = scheduler.receive(m.WorkerHello)
        assert isinstance(hello, m.WorkerHello)
        # 0.01 GiB of float32 pages: 16 positions x 30 layers x 3 kv heads x 64 x 2 (keys, values) x 4 bytes each.
        assert (hello.role, hello.vocab_size, hello.max_model_len) == ("target", 49152, 256)
        assert (hello.num_kv_pages, hello.kv_page_size) == (int(0.01 * 2**30) // (16 * 30 * 3 * 64 * 2 * 4), 16)
        early = m.StepRequest(1, hello.incarnation, [m.SeqWork("r", [0], 0, [1, 2, 3], True, GREEDY)])
        scheduler.send(early)  # while it is still starting: must be refused, and never run later
        states = []
        refused = None
        while "READY" not in states:
            message = scheduler.receive(msgspec.Struct)
            if isinstance(message, m.LifecycleReport):
                states.append(message.state)
                # Whatever its kernels, the hello's draft limit stands (only --require-batch-invariance lowers it).
                assert message.max_draft_tokens is None
                if message.state == "READY":
                    assert message.batch_invariant == (os.environ.get("SPECSERVE_NATIVE_OPS") != "0")
                    # Its warm-up steps, timed: one sequence and several, decoding and verifying.
                    assert {t.decode_rows for t in message.step_timings} >= {1, 9}
                    assert all(t.duration_ms > 0 for t in message.step_timings)
            elif isinstance(message, m.StepRefused):
                refused = message
            elif isinstance(message, m.StepResult):
                raise AssertionError("a step sent before READY was run")
        assert states == ["LOADING", "ALLOCATING", "WARMING", "READY"]
        assert refused is not None and refused.step_id == 1 and "not READY" in refused.reason
        assert (tmp_path / "status").read_text().splitlines()[0] == "READY"

        scheduler.send(m.StepRequest(2, hello.incarnation, [m.SeqWork("r", [0], 0, [1, 2, 3], True, GREEDY)]))
        result = scheduler.receive(m.StepResult)
        assert isinstance(result, m.StepResult) and result.step_id == 2 and len(result.outputs[0].token_ids) == 1

        # Inconsistent steps are refused and change nothing: a page outside the cache, too few pages, a page two
        # sequences write.
        bad = [
            [m.SeqWork("s", [99], 0, [5], True, GREEDY)],
            [m.SeqWork("r", [0], 16, [5], True, GREEDY)],
            [m.SeqWork("r", [0], 3, [5], True, GREEDY), m.SeqWork("s", [0, 1], 0, [5], True, GREEDY)],
        ]
        for step_id, seqs in enumerate(bad, start=3):
            scheduler.send(m.StepRequest(step_id, hello.incarnation, seqs))
            refusal = scheduler.receive(m.StepRefused)
            assert isinstance(refusal, m.StepRefused) and refusal.step_id == step_id
        # A step for another incarnation (an earlier run of this worker id) is dropped without an answer.
        scheduler.send(m.StepRequest(6, hello.incarnation + 1, [m.SeqWork("r", [0], 3, [5], True, GREEDY)]))
        scheduler.send(m.StepRequest(7, hello.incarnation, [m.SeqWork("r", [0], 3, [5], True, GREEDY)]))
        assert scheduler.receive(m.StepResult).step_id == 7  # type: ignore[attr-defined]

        scheduler.send(m.Drain(hello.incarnation))  # told to stop without a signal: the scheduler gave up on it
        assert worker.wait(30) == EXIT_DISMISSED
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


@pytest.mark.parametrize("required", [False, True])
def test_a_worker_whose_steps_are_not_batch_invariant_says_so_at_ready(
    default_model_dir: Path, scheduler: FakeScheduler, tmp_path: Path, required: bool
) -> None:
    """On torch's library matmuls a verify row may round differently from its decode step: the worker says so, and
    verifies drafts (lossless in distribution) unless told --require-batch-invariance, when it takes none."""
    worker = _start_worker(
        default_model_dir,
        scheduler.address,
        tmp_path,
        env={"SPECSERVE_NATIVE_OPS": "0"},
        args=("--require-batch-invariance",) if required else (),
    )
    try:
        hello = scheduler.receive(m.WorkerHello)
        assert isinstance(hello, m.WorkerHello) and hello.max_draft_tokens > 0
        while (report := scheduler.receive(m.LifecycleReport)).state != "READY":  # type: ignore[attr-defined]
            assert report.max_draft_tokens is None  # type: ignore[attr-defined]
        assert report.batch_invariant is False  # type: ignore[attr-defined]
        assert report.max_draft_tokens == (0 if required else None)  # type: ignore[attr-defined]
        log = (tmp_path / "worker.log").read_text()
        assert ("speculation.off" in log) == required
        assert ("steps.not_batch_invariant" in log) == (not required)
        scheduler.send(m.Drain(hello.incarnation))
        assert worker.wait(30) == EXIT_DISMISSED
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_a_worker_told_to_stop_during_start_up_stops_and_exits_dismissed(
    default_model_dir: Path, scheduler: FakeScheduler, tmp_path: Path
) -> None:
    worker = _start_worker(default_model_dir, scheduler.address, tmp_path)
    try:
        hello = scheduler.receive(m.WorkerHello)
        scheduler.send(m.Drain(hello.incarnation))  # as the scheduler does for an incompatible worker
        # Stopped in order, but not at its own request: the status says so, for a supervisor to start a fresh one.
        assert worker.wait(120) == EXIT_DISMISSED
        assert (tmp_path / "status").read_text().splitlines()[0] == "STOPPED"
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_a_worker_whose_scheduler_goes_away_exits_dismissed_for_a_fresh_start_to_register(
    default_model_dir: Path,
    scheduler: FakeScheduler,
    tmp_path: Path,
) -> None:
    worker = _start_worker(default_model_dir, scheduler.address, tmp_path)
    try:
        while scheduler.receive(m.LifecycleReport).state != "READY":  # type: ignore[attr-defined]
            pass
        # A restarted scheduler would not know this worker, and nothing it holds is wanted any more.
        scheduler.socket.close(0)
        assert worker.wait(30) == EXIT_DISMISSED
        assert (tmp_path / "status").read_text().splitlines()[0] == "FAILED"
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_sigterm_drains_steps_still_run_then_drain_stops_it_and_a_second_signal_exits_at_once(
    default_model_dir: Path,
    scheduler: FakeScheduler,
    tmp_path: Path,
) -> None:
    for second_signal in (False, True):
        worker = _start_worker(default_model_dir, scheduler.address, tmp_path)
        scheduler.identity = b""
        try:
            hello = scheduler.receive(m.WorkerHello)
            assert isinstance(hello, m.WorkerHello)
            while scheduler.receive(m.LifecycleReport).state != "READY":  # type: ignore[attr-defined]
                pass
            worker.send_signal(signal.SIGTERM)
            assert scheduler.receive(m.LifecycleReport).state == "DRAINING"  # type: ignore[attr-defined]
            # What was placed here still runs while it drains.
            scheduler.send(m.StepRequest(1, hello.incarnation, [m.SeqWork("r", [0], 0, [1, 2, 3], True, GREEDY)]))
            assert scheduler.receive(m.StepResult).step_id == 1  # type: ignore[attr-defined]
            if second_signal:
                worker.send_signal(signal.SIGTERM)
                assert worker.wait(10) == 1
            else:
                scheduler.send(m.Drain(hello.incarnation))
                assert scheduler.receive(m.LifecycleReport).state == "STOPPED"  # type: ignore[attr-defined]
                assert worker.wait(30) == 0
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()


# Graphs on this CPU: the recording backend replays the same static-buffer forward a CUDA graph would, on torch's ops.
GRAPHS_ON_CPU = {"SPECSERVE_GRAPH_BACKEND": "recording", "SPECSERVE_NATIVE_OPS": "0"}
SMALL_GRAPHS = ("--max-num-seqs", "2", "--max-draft-tokens", "2")


def _serve_steps(scheduler: FakeScheduler, incarnation: int) -> list[int]:
    """A prompt, then decode steps and a verify step of one sequence: the tokens the worker wrote."""
    tokens = [1, 2, 3, 4, 5]
    step_id = 0

    def step(new: list[int], start: int, num_drafts: int = 0) -> list[int]:
        nonlocal step_id
        step_id += 1
        work = m.SeqWork("r", [0, 1], start, new, True, GREEDY, num_draft_tokens=num_drafts)
        scheduler.send(m.StepRequest(step_id, incarnation, [work]))
        result = scheduler.receive(m.StepResult)
        assert isinstance(result, m.StepResult) and result.step_id == step_id
        return result.outputs[0].token_ids

    written = step(tokens, 0)
    for _ in range(3):
        written += step([written[-1]], len(tokens) + len(written) - 1)
    # A verify step: the last token and two drafts (the first of them the token a plain step would write).
    written += step([written[-1], 7, 8], len(tokens) + len(written) - 1, num_drafts=2)
    return written


def test_a_worker_serves_from_its_graphs_as_it_does_without_them_and_says_which_at_ready(
    default_model_dir: Path, scheduler: FakeScheduler, tmp_path: Path
) -> None:
    """The same steps (a prompt, decode steps, a verify step) through a worker with graphs and one without: the same
    tokens; each READY report says what it captured."""
    written: dict[str, list[int]] = {}
    for graphs in ("off", "on"):
        worker = _start_worker(
            default_model_dir, scheduler.address, tmp_path, GRAPHS_ON_CPU, ("--cuda-graphs", graphs, *SMALL_GRAPHS)
        )
        try:
            hello = scheduler.receive(m.WorkerHello)
            assert isinstance(hello, m.WorkerHello)
            while (report := scheduler.receive(m.LifecycleReport)).state != "READY":  # type: ignore[attr-defined]
                pass
            said = report.graphs  # type: ignore[attr-defined]
            assert said == "off" if graphs == "off" else said.startswith("6 graphs (recording)"), said
            written[graphs] = _serve_steps(scheduler, hello.incarnation)
            scheduler.send(m.Drain(hello.incarnation))
            assert worker.wait(30) == EXIT_DISMISSED
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    assert written["on"] == written["off"] and len(written["on"]) >= 5
    assert "graphs.captured" in (tmp_path / "worker.log").read_text()


def test_a_worker_whose_capture_fails_with_fallback_serves_eagerly_and_says_why(
    default_model_dir: Path, scheduler: FakeScheduler, tmp_path: Path
) -> None:
    worker = _start_worker(
        default_model_dir,
        scheduler.address,
        tmp_path,
        {**GRAPHS_ON_CPU, "SPECSERVE_FAULT": "worker-0:capture=3:raise"},
        ("--cuda-graphs", "fallback", *SMALL_GRAPHS),
    )
    try:
        hello = scheduler.receive(m.WorkerHello)
        assert isinstance(hello, m.WorkerHello)
        while (report := scheduler.receive(m.LifecycleReport)).state != "READY":  # type: ignore[attr-defined]
            pass
        said = report.graphs  # type: ignore[attr-defined]
        assert said.startswith("fallback: eager (capturing graph 3 of 6") and "InjectedFault" in said, said
        assert len(_serve_steps(scheduler, hello.incarnation)) >= 5
        scheduler.send(m.Drain(hello.incarnation))
        assert worker.wait(30) == EXIT_DISMISSED
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_graphs_on_a_cpu_are_refused_by_name() -> None:
    refused = subprocess.run(
        [sys.executable, "-m", "gpu_worker", "--model", "x", "--scheduler-address", "tcp://127.0.0.1:1"]
        + ["--cuda-graphs", "on", "--device", "cpu", "--insecure-loopback"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "SPECSERVE_GRAPH_BACKEND"},
    )
    assert refused.returncode != 0 and "--cuda-graphs on needs a CUDA device" in refused.stderr
