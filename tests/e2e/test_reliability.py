"""No half-built worker ever gets work, and no request is ever lost: real processes, real faults.

Faults are injected with SPECSERVE_FAULT (common/faults.py) or by signals. Every test
checks what a client sees: each request completes, greedy output equals the undisturbed
run (float32, so equal means token for token), and no token is missing or duplicated.
Measured times to recover are printed (`pytest -s`) for docs/reliability.md.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import zmq

from common.draft_spec import DraftKind, DraftSpec
from common.text.tokenizer import Tokenizer
from proto import messages as m
from proto import specserve_pb2 as pb
from specserve.stack import StackConfig
from tests.e2e.stack import Stack, running_stack

FAST_FAILURE = ("--heartbeat-timeout-s", "2", "--phase-timeout-s", "10")
SMALL_WORKER = ("--phase-timeout-s", "12", "--heartbeat-interval-s", "0.2")


def prompts(model_dir: Path, n: int) -> list[list[int]]:
    """n different real-text prompts of 8 to 40 tokens."""
    words = Tokenizer.load(model_dir).encode(
        "The history of the lighthouse begins with fires lit on hills to guide ships home. Later, towers of stone "
        "carried lamps of oil, then lenses that bent the light into beams seen from far out at sea. Keepers lived "
        "beside them, trimming wicks and winding clockwork through the long nights of winter storms."
    )
    return [words[i % 20 : i % 20 + 8 + (i * 7) % 33] for i in range(n)]


def greedy(ids: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


def run_all(stack: Stack, requests: list[pb.GenerateRequest], stagger_s: float = 0.0) -> list[list[int]]:
    def run(index: int) -> list[int]:
        time.sleep(index * stagger_s)
        return stack.generate(requests[index], timeout_s=300).token_ids

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(run, range(len(requests))))


def wait_for(condition, timeout_s: float, what: str, stack: Stack):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s\n{stack.logs()}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def two_workers(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackConfig(
        default_model_dir,
        dtype="float32",
        num_workers=2,
        max_num_seqs=16,
        max_model_len=512,
        num_threads_per_worker=1,
        scheduler_args=FAST_FAILURE,
        worker_args=SMALL_WORKER,
    )
    with running_stack(options, tmp_path_factory.mktemp("two_workers")) as stack:
        yield stack


# ---------------------------------------------------------------- start-up failures


@pytest.mark.parametrize("action", ["raise", "hang", "exit"])
@pytest.mark.parametrize("phase", ["STARTING", "LOADING", "ALLOCATING", "WARMING"])
def test_a_process_failing_in_any_start_up_phase_never_gets_a_step(two_workers: Stack, phase: str, action: str) -> None:
    # A hang before any real work (STARTING, LOADING) is ended by the worker's own watchdog, given a short deadline
    # here; in ALLOCATING and WARMING the scheduler's deadline (10 s, the worker's own is 12) declares it FAILED.
    own_deadline = ("--phase-timeout-s", "3") if action == "hang" and phase in ("STARTING", "LOADING") else ()
    never_gets_a_step(two_workers, f"faulty-{phase.lower()}-{action}", phase, action, own_deadline)


# A worker on this CPU that captures its graphs through the recording backend (modeling/model/graphs.py): a few
# buckets (2 sequences, verify steps of 3 tokens), on torch's ops as on a GPU.
GRAPHS_ON_CPU = {"SPECSERVE_GRAPH_BACKEND": "recording", "SPECSERVE_NATIVE_OPS": "0"}
SMALL_GRAPHS = ("--cuda-graphs", "on", "--max-num-seqs", "2", "--max-draft-tokens", "2")


@pytest.mark.parametrize("action", ["raise", "hang", "exit"])
def test_a_worker_whose_graph_capture_fails_part_way_never_gets_a_step(two_workers: Stack, action: str) -> None:
    """The founding bug, SGLang's: a capture that raised half-way and was swallowed left a half-built worker serving.
    Here the capture is the last part of WARMING: a fault at the second of its graphs leaves the worker FAILED (or
    dead), never READY, and no step is sent to it, while the others serve."""
    never_gets_a_step(two_workers, f"faulty-capture-{action}", "capture=2", action, SMALL_GRAPHS, GRAPHS_ON_CPU)


def never_gets_a_step(
    stack: Stack,
    worker_id: str,
    when: str,
    action: str,
    extra_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> None:
    started = time.monotonic()
    stack.start_worker(worker_id, fault=f"worker-{worker_id}:{when}:{action}", extra_args=extra_args, env=env)
    process = stack.processes[f"worker-{worker_id}"]
    # The others keep serving while it fails.
    assert len(stack.generate(greedy([1, 2, 3, 4], 8)).token_ids) == 8
    log_path = stack.log_dir / f"worker-{worker_id}.log"
    if when in ("STARTING", "LOADING") and action == "exit":
        # It exits within moments of queueing its hello (LOADING begins right after it), and the
        # hello may then never leave its socket, still connecting (a crash loses what is queued):
        # the scheduler either never knew it or declares it DEAD.
        assert process.wait(30) != 0
        time.sleep(1.0)  # whatever it did send has arrived by now
        if stack.process_info(f"worker-{worker_id}") is None:
            assert "step" not in log_path.read_text()
            return
    failed = wait_for(
        lambda: (p := stack.process_info(f"worker-{worker_id}")) and p.state in ("FAILED", "DEAD") and p,
        60,
        f"{worker_id} FAILED or DEAD",
        stack,
    )
    expected = {"raise": "InjectedFault", "hang": "--phase-timeout-s", "exit": "no heartbeat"}[action]
    phase = "WARMING" if when.startswith("capture") else when
    assert expected in failed.failure and (action == "exit" or phase in failed.failure), failed.failure
    if when.startswith("capture") and action == "raise":
        assert "capturing graph 2 of" in failed.failure, failed.failure
    assert process.wait(30) != 0  # raise: 1, exit: 3, hang: its own watchdog ends it with 1
    print(f"\n{when} {action}: {failed.state} after {time.monotonic() - started:.1f} s: {failed.failure}")
    log = log_path.read_text()
    # No step was ever sent to it, not even a refused one (a worker logs each request it starts and each refusal).
    assert not any(event in log for event in ("seq.started", "step.refused", "step.done")), log
    assert "READY" not in log.replace("WARMING", "")


# ---------------------------------------------------------------- a worker dies


def test_32_streams_survive_a_sigkilled_worker_token_for_token(two_workers: Stack, default_model_dir: Path) -> None:
    requests = [greedy(ids, 24) for ids in prompts(default_model_dir, 32)]
    undisturbed = run_all(two_workers, requests)
    with ThreadPoolExecutor(1) as killer:

        def kill_soon() -> float:
            wait_for(lambda: two_workers.info().num_running >= 24, 30, "24 requests running", two_workers)
            two_workers.processes["worker-1"].send_signal(signal.SIGKILL)
            return time.monotonic()

        killed = killer.submit(kill_soon)
        disturbed = run_all(two_workers, requests)
        killed_at = killed.result()
    assert disturbed == undisturbed  # all 32 complete, none with a missing or duplicated token
    lost = wait_for(
        lambda: (p := two_workers.process_info("worker-1")) and p.state == "DEAD" and p,
        10,
        "worker-1 DEAD",
        two_workers,
    )
    print(
        f"\nSIGKILL: worker-1 DEAD ({lost.failure}); "
        f"every request done {time.monotonic() - killed_at:.1f} s after the kill"
    )

    # Restarted (as `specserve up` would), it comes back READY with a new incarnation and takes new work.
    old_incarnation = lost.incarnation
    two_workers.start_worker(1)
    back = wait_for(
        lambda: (p := two_workers.process_info("worker-1")) and p.state == "READY" and p,
        60,
        "worker-1 READY again",
        two_workers,
    )
    assert back.incarnation != old_incarnation
    # A message from the old incarnation is dropped: it changes nothing.
    context = zmq.Context()
    stale = two_workers.insider(context, "worker")
    codec: m.Codec[m.WorkerToScheduler] = m.Codec(m.WorkerToScheduler)
    stale.send(codec.encode(m.WorkerFailed("worker-1", old_incarnation, "READY", "RuntimeError", "a ghost")))
    stale.send(codec.encode(m.LifecycleReport("worker-1", old_incarnation, "STOPPED", "READY", 1.0)))
    time.sleep(0.5)
    stale.close(0)
    context.term()
    after = two_workers.process_info("worker-1")
    assert after is not None and (after.state, after.incarnation, after.failure) == ("READY", back.incarnation, "")
    assert run_all(two_workers, requests[:8]) == undisturbed[:8]
    log = (two_workers.log_dir / "worker-1.log").read_text()
    assert (
        f"incarnation={back.incarnation}" in log and "seq.started" in log.split(f"incarnation={back.incarnation}", 1)[1]
    )


def test_a_worker_crashing_or_hanging_in_a_step_loses_no_request(two_workers: Stack, default_model_dir: Path) -> None:
    requests = [greedy(ids, 16) for ids in prompts(default_model_dir, 12)]
    undisturbed = run_all(two_workers, requests)
    for index, fault in enumerate(("step=6:raise", "step=6:exit", "step=6:hang")):
        name = f"crashy-{index}"
        two_workers.start_worker(name, fault=f"worker-{name}:{fault}", extra_args=("--step-timeout-s", "3"))
        wait_for(
            lambda: (p := two_workers.process_info(f"worker-{name}")) and p.state == "READY",
            60,
            f"{name} READY",
            two_workers,
        )
        started = time.monotonic()
        assert run_all(two_workers, requests, stagger_s=0.02) == undisturbed, fault
        process = two_workers.process_info(f"worker-{name}")
        assert process is not None and process.state in ("FAILED", "DEAD"), process
        print(
            f"\n{fault}: {process.state} ({process.failure}); "
            f"all {len(requests)} done in {time.monotonic() - started:.1f} s"
        )
        assert two_workers.processes[f"worker-{name}"].wait(30) != 0


# ---------------------------------------------------------------- drain


def test_sigterm_drains_a_worker_its_requests_finish_there_and_it_exits_0(
    default_model_dir: Path,
    tmp_path: Path,
) -> None:
    options = StackConfig(
        default_model_dir,
        dtype="float32",
        num_workers=2,
        max_num_seqs=16,
        max_model_len=512,
        num_threads_per_worker=1,
        scheduler_args=FAST_FAILURE,
        worker_args=SMALL_WORKER,
    )
    stack = Stack(options, tmp_path)
    try:
        stack.start()
        requests = [greedy(ids, 32) for ids in prompts(default_model_dir, 12)]
        undisturbed = run_all(stack, requests)
        with ThreadPoolExecutor(1) as signaller:

            def drain_soon() -> tuple[float, int]:
                wait_for(lambda: stack.info().num_running >= 10, 30, "10 requests running", stack)
                in_flight = stack.info().num_running
                stack.processes["worker-0"].send_signal(signal.SIGTERM)
                return time.monotonic(), in_flight

            signalled = signaller.submit(drain_soon)
            disturbed = run_all(stack, requests)
            signalled_at, in_flight = signalled.result()
        assert disturbed == undisturbed
        assert stack.processes["worker-0"].wait(30) == 0
        print(
            f"\nSIGTERM with {in_flight} requests in flight: "
            f"worker-0 exited 0 {time.monotonic() - signalled_at:.1f} s later "
            "(at most; measured after the last request)"
        )
        scheduler_log = (tmp_path / "scheduler.log").read_text()
        lost = [line for line in scheduler_log.splitlines() if "worker.lost" in line and "worker-0" in line]
        assert len(lost) == 1 and "num_requeued=0" in lost[0] and "STOPPED" in lost[0]  # nothing had to be recomputed
        assert "DRAINING" in (tmp_path / "worker-0.log").read_text()
        assert run_all(stack, requests[:4]) == undisturbed[:4]  # worker-1 serves on
    finally:
        stack.stop()


# ---------------------------------------------------------------- the draft service dies


def test_killing_the_draft_service_mid_run_fails_no_request_and_changes_no_token(
    default_model_dir: Path,
    tmp_path: Path,
) -> None:
    options = StackConfig(
        default_model_dir,
        dtype="float32",
        num_workers=1,
        max_num_seqs=8,
        max_model_len=512,
        scheduler_args=FAST_FAILURE,
        draft=DraftSpec(DraftKind.NGRAM),
        speculation_policy="fixed",
    )
    stack = Stack(options, tmp_path)
    try:
        stack.start()
        wait_for(lambda: (p := stack.process_info("draft-0")) and p.state == "READY", 60, "draft READY", stack)
        text = Tokenizer.load(default_model_dir).encode("one two three four, one two three four, one two three four,")
        requests = [greedy(text[: 10 + i], 48) for i in range(4)]
        undisturbed = run_all(stack, requests)
        assert stack.info().speculation.num_accepted_draft_tokens > 0
        with ThreadPoolExecutor(1) as killer:

            def kill_soon() -> float:
                time.sleep(0.5)
                stack.processes["draft"].send_signal(signal.SIGKILL)
                return time.monotonic()

            killed = killer.submit(kill_soon)
            assert run_all(stack, requests) == undisturbed
            print(
                f"\ndraft SIGKILL: all {len(requests)} requests done "
                f"{time.monotonic() - killed.result():.1f} s after the kill"
            )
        wait_for(lambda: (p := stack.process_info("draft-0")) and p.state == "DEAD", 10, "draft DEAD", stack)
        assert run_all(stack, requests) == undisturbed  # and without it
    finally:
        stack.stop()
