"""Messages the scheduler believes only from their owner, and only when they make sense: checked before any state.

Each case is a well-formed message from something that can reach the scheduler's sockets
(a second gateway, a process posing as a worker). None may crash the scheduler, change a
user's output, or take a healthy worker down; each is counted as refused.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from proto import messages as m
from proto.lifecycle import State
from tests.unit.scheduler_fakes import DEFAULT_TOKEN, EOS, FakeWorker, Sim

OTHER_GATEWAY = b"gateway-2"


def test_a_worker_message_from_another_socket_than_its_hello_is_refused() -> None:
    sim = Sim()
    worker = sim.worker("w0").start()
    sim.submit("r1", max_tokens=3)
    step = worker.step()
    impostor = FakeWorker(sim, "w0", identity=b"impostor")
    # A forged result (token 1 for everyone) and a forged failure report, from another socket.
    forged = m.StepResult(
        worker_id="w0",
        incarnation=worker.incarnation,
        step_id=step.step_id,
        outputs=[m.SeqOutput(seq.request_id, [1]) for seq in step.seqs],
        duration_ms=10.0,
    )
    assert not impostor.send(forged)
    assert not impostor.send(m.WorkerFailed("w0", worker.incarnation, State.READY, "RuntimeError", "forged"))
    assert sim.process("w0").state == State.READY
    assert sim.info().protocol_errors["worker.not_owner"] == 2
    worker.run()
    assert sim.streamed("r1") == [DEFAULT_TOKEN] * 3  # the real worker's tokens, none of the impostor's
    assert sim.finish_reason("r1") == "length"


def test_a_second_process_with_a_live_workers_id_is_told_to_stop_and_the_first_serves_on() -> None:
    sim = Sim()
    first = sim.worker("w0", identity=b"w0/1").start()
    sim.submit("r1", max_tokens=2)
    newcomer = sim.worker("w0", identity=b"w0/2", incarnation=2)
    assert newcomer.hello()  # handled: refused, counted, and the newcomer told to stop
    newcomer.inbox()
    assert [d.incarnation for d in newcomer.drains] == [2]
    assert not newcomer.report(State.LOADING)  # it is nobody: its reports are dropped
    assert sim.info().protocol_errors["worker.duplicate_id"] == 1
    assert (sim.process("w0").incarnation, sim.process("w0").state) == (1, State.READY)
    first.run()
    assert sim.finish_reason("r1") == "length"


def test_a_restarted_process_replaces_its_predecessor_once_that_ones_connection_is_gone() -> None:
    sim = Sim()
    sim.worker("w0", identity=b"w0/1").start()
    sim.submit("r1", max_tokens=2)
    sim.disconnected.add(b"w0/1")  # killed: the kernel closed its connection before the supervisor started another
    restarted = sim.worker("w0", identity=b"w0/2", incarnation=2).start()
    restarted.inbox()
    assert not restarted.drains and "worker.duplicate_id" not in sim.info().protocol_errors
    assert (sim.process("w0").incarnation, sim.process("w0").state) == (2, State.READY)
    restarted.run()
    assert sim.finish_reason("r1") == "length"  # recomputed on the new incarnation


def test_a_gateway_may_abort_only_its_own_requests() -> None:
    sim = Sim()
    worker = sim.worker("w0").start()
    sim.submit("r1", max_tokens=3)
    sim.core.on_gateway_message(OTHER_GATEWAY, m.GatewayHello("gateway-2", m.PROTOCOL_VERSION), sim.now_s)
    sim.core.on_gateway_message(OTHER_GATEWAY, m.AbortRequest("r1", "forged"), sim.now_s)
    sim.collect()
    assert sim.info().protocol_errors["gateway.not_owner"] == 1
    worker.run()
    assert len(sim.streamed("r1")) == 3 and sim.finish_reason("r1") == "length"  # its owner hears how it ended


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"num_kv_pages": 2**62}, "num_kv_pages"),
        ({"kv_page_size": 2**40}, "kv_page_size"),
        ({"incarnation": 2**62}, "incarnation"),
        ({"incarnation": -5}, "incarnation"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"max_draft_tokens": 10**6}, "max_draft_tokens"),
        ({"model_name": "x" * 100_000}, "model_name"),
    ],
)
def test_an_unbelievable_hello_builds_nothing_and_leaves_the_live_worker_alone(
    overrides: dict[str, object], named: str
) -> None:
    from scheduler.hellos import hello_problem

    sim = Sim()
    worker = sim.worker("w0").start()
    bogus = FakeWorker(sim, "w0", identity=b"impostor", **overrides)
    assert named in hello_problem(bogus.hello_message, 10**18)
    assert not bogus.hello()  # no record built (a page pool of 2^62 pages was a MemoryError)
    assert sim.process("w0").state == State.READY and sim.process("w0").incarnation == worker.incarnation
    assert sim.info().protocol_errors["worker.bad_hello"] == 1
    sim.submit("r1", max_tokens=2)
    worker.run()
    assert sim.finish_reason("r1") == "length"


@pytest.mark.parametrize(
    ("prompt_ids", "stop_ids", "named"),
    [
        ([100, 49152, 101], [EOS], "prompt_token_ids holds 49152"),
        ([100, -1], [EOS], "prompt_token_ids holds -1"),
        ([100, 101], [10**9], "stop_token_ids holds 1000000000"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_before_any_worker_sees_them(
    prompt_ids: list[int], stop_ids: list[int], named: str
) -> None:
    sim = Sim()
    worker = sim.worker("w0").start()
    sim.submit("bad", prompt_ids, stop_token_ids=stop_ids)
    (error,) = sim.errors("bad")
    assert error.code == "INVALID_ARGUMENT" and named in error.message
    assert worker.pending_step() is None and sim.process("w0").state == State.READY


def test_a_request_queued_before_any_worker_is_checked_against_the_vocabulary_before_a_worker_sees_it() -> None:
    sim = Sim()
    sim.submit("early", [100, 60000, 101])  # no target has said hello: the vocabulary is not known yet
    sim.submit("fine", [100, 101])
    worker = sim.worker("w0").start()
    (error,) = sim.errors("early")
    assert error.code == "INVALID_ARGUMENT" and "60000" in error.message
    assert all(seq.request_id == "fine" for step in worker.all_steps() for seq in step.seqs)
    worker.run()
    assert sim.finish_reason("fine") == "length" and sim.process("w0").state == State.READY


@pytest.mark.parametrize(
    ("sampling", "named"),
    [
        (m.SamplingParams(temperature=math.nan), "temperature"),
        (m.SamplingParams(temperature=-1.0), "temperature"),
        (m.SamplingParams(temperature=1.0, top_p=0.0), "top_p"),
        (m.SamplingParams(temperature=1.0, top_p=math.inf), "top_p"),
        (m.SamplingParams(temperature=1.0, top_k=-3), "top_k"),
        (m.SamplingParams(temperature=1.0, seed=-1), "seed"),
    ],
)
def test_sampling_values_out_of_range_are_refused_by_name(sampling: m.SamplingParams, named: str) -> None:
    sim = Sim()
    sim.worker("w0").start()
    sim.submit("bad", sampling=sampling)
    (error,) = sim.errors("bad")
    assert error.code == "INVALID_ARGUMENT" and named in error.message


def _serve_until_done(sim: Sim, poison: str, max_workers: int = 8) -> list[str]:
    """Answer every step on a fresh worker; a step holding `poison` kills the worker it runs on (a new incarnation
    takes over). Returns the ids of the workers lost."""
    lost: list[str] = []
    worker = sim.worker("w0").start()
    for _ in range(2000):
        step = worker.pending_step()
        if step is None:
            return lost
        if any(seq.request_id == poison for seq in step.seqs):
            worker.fail("Segmentation fault in a kernel")
            lost.append(f"w0#{worker.incarnation}")
            assert len(lost) <= max_workers
            worker = sim.worker("w0", incarnation=worker.incarnation + 1).start()
        else:
            worker.complete()
    raise AssertionError("still stepping")


def test_a_request_that_kills_every_worker_it_runs_on_fails_alone_after_its_retries() -> None:
    sim = Sim(max_request_retries=2)
    innocents = [f"r{i}" for i in range(6)]
    for request_id in innocents[:3]:
        sim.submit(request_id, max_tokens=5)
    sim.submit("poison", max_tokens=5)
    for request_id in innocents[3:]:
        sim.submit(request_id, max_tokens=5)
    lost = _serve_until_done(sim, "poison")
    # Two batches it was in (one lost worker could be chance), then its own step, its third loss: past 2 retries.
    assert len(lost) == 3
    (error,) = sim.errors("poison")
    assert (
        error.code == "INTERNAL"
        and "--max-request-retries 2" in error.message
        and "Segmentation fault" in error.message
    )
    for request_id in innocents:  # every other request completes, as it would have without the poison
        assert sim.streamed(request_id) == [DEFAULT_TOKEN] * 5 and sim.finish_reason(request_id) == "length"
        assert not sim.errors(request_id)


def test_a_step_refused_for_one_requests_content_fails_that_request_and_keeps_the_worker() -> None:
    sim = Sim()
    sim.submit("good", max_tokens=3)
    sim.submit("bad", max_tokens=3)
    worker = sim.worker("w0").start()
    step = worker.step()
    assert {seq.request_id for seq in step.seqs} == {"good", "bad"}
    assert worker.send(
        m.StepRefused(
            "w0",
            worker.incarnation,
            step.step_id,
            State.READY,
            "request bad: a token id is outside the vocabulary 0..49151",
            request_id="bad",
        )
    )
    (error,) = sim.errors("bad")
    assert error.code == "INVALID_ARGUMENT" and "outside the vocabulary" in error.message
    assert sim.process("w0").state == State.READY  # not the worker's fault
    worker.run()
    assert sim.streamed("good") == [DEFAULT_TOKEN] * 3 and sim.finish_reason("good") == "length"


def test_a_gone_process_leaves_the_listing_after_the_stated_time() -> None:
    sim = Sim(gone_listed_s=300.0)
    old = sim.worker("w0").start()
    old.fail()
    sim.worker("w1").start()
    assert {p.process_id: p.state for p in sim.info().processes} == {"w0": State.FAILED, "w1": State.READY}
    sim.advance(299.0)
    assert "w0" in {p.process_id for p in sim.info().processes}
    sim.advance(2.0)
    assert [p.process_id for p in sim.info().processes] == ["w1"]


def test_heartbeats_are_believed_from_the_workers_heartbeat_socket_too() -> None:
    sim = Sim(heartbeat_timeout_s=5.0)
    worker = sim.worker("w0").start()
    beats = FakeWorker(sim, "w0", identity=m.heartbeat_identity(worker.identity))
    for _ in range(4):
        sim.advance(3.0)
        assert beats.send(m.Heartbeat("w0", worker.incarnation, State.READY, 0, 0))
        sim.check_timeouts()
    assert sim.process("w0").state == State.READY  # 12 s without a word on its main socket, alive by its heartbeats
    # The heartbeat socket is believed for heartbeats and the watchdog's report only.
    assert not beats.send(m.LifecycleReport("w0", worker.incarnation, State.DRAINING, State.READY, 1.0))


def test_a_worker_caps_its_pages_at_what_the_scheduler_believes(tiny_llama_folder: Path) -> None:
    """A huge budget for a tiny model buys more pages than a hello may claim: the worker stops at the protocol's cap."""
    from common.process_config import ProcessConfig
    from gpu_worker.config import WorkerConfig
    from gpu_worker.memory import num_kv_pages
    from modeling.model.config import ModelConfig

    process = ProcessConfig(
        worker_id="w",
        scheduler_address="inproc://x",
        device="cpu",
        dtype="float32",
        heartbeat_interval_s=1.0,
        phase_timeout_s=60.0,
        step_timeout_s=60.0,
        drain_timeout_s=10.0,
        num_threads=0,
        status_file=None,
    )
    config = WorkerConfig(
        process=process,
        model=tiny_llama_folder,
        max_model_len=1 << 20,
        kv_cache_memory_gib=4096.0,
        page_size=16,
        max_num_seqs=100_000,
        max_num_batched_tokens=64,
        max_draft_tokens=6,
    )
    pages, why = num_kv_pages(config, ModelConfig.from_folder(tiny_llama_folder))
    assert pages == m.MAX_KV_PAGES and "capped" in why
