"""Malformed messages at the target worker's, the draft service's and the gateway's sockets while they serve.

Each gets at least 1,000 hypothesis-generated frames (tests/fuzz_frames.py) on its
socket from the scheduler's side; every one is counted and dropped, the process keeps
serving, and afterwards it answers exactly as it did before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings

from common.text.tokenizer import Tokenizer
from proto import messages as m
from proto import specserve_pb2 as pb
from tests.fuzz_frames import malformed_frames
from tests.integration.test_draft_process import _start_draft, _stop
from tests.integration.test_worker_process import GREEDY, FakeScheduler, _start_worker, scheduler  # noqa: F401  (fixture)
from tests.unit.test_gateway_server import collect, gateway, run, text_script, tokenizer  # noqa: F401  (fixtures)
from tests.unit.test_messages import (
    GATEWAY_TO_SCHEDULER,
    SCHEDULER_TO_DRAFT,
    SCHEDULER_TO_GATEWAY,
    SCHEDULER_TO_WORKER,
    WORKER_TO_SCHEDULER,
)

FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), database=None)


def _ready(scheduler: FakeScheduler) -> m.WorkerHello:  # noqa: F811
    hello = scheduler.receive(m.WorkerHello)
    assert isinstance(hello, m.WorkerHello)
    while scheduler.receive(m.LifecycleReport).state != "READY":  # type: ignore[attr-defined]
        pass
    return hello


def test_the_worker_drops_malformed_frames_and_serves_on(
    default_model_dir: Path,
    scheduler: FakeScheduler,  # noqa: F811
    tmp_path: Path,
) -> None:
    worker = _start_worker(default_model_dir, scheduler.address, tmp_path)
    try:
        hello = _ready(scheduler)
        step = m.StepRequest(1, hello.incarnation, [m.SeqWork("r", [0], 0, [504, 2365, 6354, 16438], True, GREEDY)])
        scheduler.send(step)
        before = scheduler.receive(m.StepResult).outputs  # type: ignore[attr-defined]
        num_sent = 0

        @FUZZ
        @given(
            malformed_frames(SCHEDULER_TO_WORKER, [*WORKER_TO_SCHEDULER, *SCHEDULER_TO_DRAFT, *GATEWAY_TO_SCHEDULER])
        )
        def throw(frame: bytes) -> None:
            nonlocal num_sent
            scheduler.socket.send_multipart([scheduler.identity, frame])
            num_sent += 1

        throw()
        assert num_sent >= 1000 and worker.poll() is None
        scheduler.send(m.StepRequest(2, hello.incarnation, step.seqs))
        assert scheduler.receive(m.StepResult).outputs == before  # type: ignore[attr-defined]
        log = (tmp_path / "worker.log").read_text()
        assert "kind=decode" in log and log.count("kind=decode") == 1  # logged once, then only counted
    finally:
        _stop(worker)


def test_the_draft_service_drops_malformed_frames_and_serves_on(scheduler: FakeScheduler, tmp_path: Path) -> None:  # noqa: F811
    draft = _start_draft("ngram", scheduler.address, tmp_path)
    try:
        hello = _ready(scheduler)
        sequence = [5, 6, 7, 8, 9, 5, 6, 7]
        scheduler.send(m.ProposeRequest(1, hello.incarnation, [m.ProposeSeq("a", 0, 0, sequence, 3, GREEDY)]))
        before = scheduler.receive(m.ProposeResult).proposals  # type: ignore[attr-defined]
        assert before[0].token_ids == [8, 9, 5]
        scheduler.send(m.ReleaseSequences(hello.incarnation, ["a"]))
        num_sent = 0

        @FUZZ
        @given(
            malformed_frames(SCHEDULER_TO_DRAFT, [*WORKER_TO_SCHEDULER, *SCHEDULER_TO_WORKER, *GATEWAY_TO_SCHEDULER])
        )
        def throw(frame: bytes) -> None:
            nonlocal num_sent
            scheduler.socket.send_multipart([scheduler.identity, frame])
            num_sent += 1

        throw()
        assert num_sent >= 1000 and draft.poll() is None
        scheduler.send(m.ProposeRequest(2, hello.incarnation, [m.ProposeSeq("a", 0, 0, sequence, 3, GREEDY)]))
        assert scheduler.receive(m.ProposeResult).proposals == before  # type: ignore[attr-defined]
    finally:
        _stop(draft)


def test_the_gateway_drops_malformed_frames_from_the_scheduler_and_serves_on(run: Any, tokenizer: Tokenizer) -> None:  # noqa: F811
    frames: list[bytes] = []

    @FUZZ
    @given(malformed_frames(SCHEDULER_TO_GATEWAY, [*GATEWAY_TO_SCHEDULER, *SCHEDULER_TO_WORKER, *WORKER_TO_SCHEDULER]))
    def generate(frame: bytes) -> None:
        frames.append(frame)

    generate()
    assert len(frames) >= 1000

    async def scenario() -> None:
        async with gateway(tokenizer, text_script(tokenizer, "still fine")) as h:
            before = await collect(h.stub.Generate(pb.GenerateRequest(prompt="x")))
            for frame in frames:
                await h.scheduler.send_raw([frame])
            after = await collect(h.stub.Generate(pb.GenerateRequest(prompt="x")))
            assert h.client.protocol_errors.total > 0
        assert [r.text for r in after] == [r.text for r in before] and "".join(r.text for r in after) == "still fine"

    run(scenario())
