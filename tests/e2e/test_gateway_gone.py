"""Requests die with their gateway, on real processes: a SIGKILLed gateway's requests are aborted once the scheduler's
grace window has passed (a SIGSTOPped one's once it has been silent for the heartbeat timeout, then the window), and
every page they held is free again; a gateway that stays connected, even idle for longer than that window, and the
requests of another gateway are never touched.

The stack's own gateway watches (GetServerInfo, /metrics) and streams a request across the kill; each gateway that
goes is started beside it with a health poll so slow that only its heartbeats speak for it between requests.
"""

from __future__ import annotations

import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from proto import messages as m
from proto import specserve_pb2_grpc as pb_grpc
from specserve.health_probes import is_serving
from specserve.stack import StackConfig, free_ports, gateway_spec
from tests.e2e.stack import Stack, collect, running_stack
from tests.e2e.test_reliability import greedy, prompts, wait_for

GRACE_S = 2.0
HEARTBEAT_TIMEOUT_S = 2.0
NUM_VICTIMS = 8


@pytest.fixture(scope="module")
def stack(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackConfig(
        default_model_dir,
        dtype="float32",
        num_workers=1,
        max_num_seqs=16,
        max_model_len=512,
        scheduler_args=("--gateway-gone-grace-s", f"{GRACE_S:g}", "--heartbeat-timeout-s", f"{HEARTBEAT_TIMEOUT_S:g}"),
    )
    with running_stack(options, tmp_path_factory.mktemp("gateway_gone")) as started:
        yield started


def start_gateway(stack: Stack, name: str) -> str:
    """A gateway next to the stack's own, with `name` as process name and gateway id; its gRPC address."""
    grpc_port, http_port = free_ports(2, taken=(stack.addresses.grpc_port, stack.addresses.http_port))
    spec = gateway_spec(stack.config, replace(stack.addresses, grpc_port=grpc_port, http_port=http_port))
    # Its health asks the scheduler once a minute: between its requests only its heartbeats are heard from it.
    stack.spawn(replace(spec, name=name, argv=[*spec.argv, "--gateway-id", name, "--health-poll-interval-s", "60"]))
    wait_for(lambda: is_serving(stack.addresses.host, grpc_port), 60, f"{name} SERVING", stack)
    return f"127.0.0.1:{grpc_port}"


def stream_long_requests(
    stub: pb_grpc.SpecServeStub, prompt_ids: list[list[int]]
) -> tuple[list[threading.Thread], list[str]]:
    """One request per prompt that would run for long, each streamed from a thread; how each ended, as they end."""
    outcomes: list[str] = []

    def stream(ids: list[int]) -> None:
        try:
            collect(stub.Generate(greedy(ids, 400), timeout=120))
            outcomes.append("completed")
        except grpc.RpcError as error:
            outcomes.append(str(error.code()))

    threads = [threading.Thread(target=stream, args=(ids,)) for ids in prompt_ids]
    for thread in threads:
        thread.start()
    return threads, outcomes


def events(stack: Stack, event: str, gateway_id: str) -> list[str]:
    """The scheduler's log lines of `event` about that gateway."""
    return [
        line
        for line in scheduler_log(stack).splitlines()
        if f"] {event} " in line and f"gateway_id={gateway_id} " in line
    ]


def scheduler_log(stack: Stack) -> str:
    return (stack.log_dir / "scheduler.log").read_text()


def metric(stack: Stack, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.addresses.http_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    (value,) = [line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")]
    return float(value)


def is_idle(stack: Stack) -> bool:
    """Nothing runs or waits, and every page of every READY target is free or held only by the prefix cache."""
    info = stack.info()
    return (info.num_running, info.num_waiting) == (0, 0) and all(
        p.num_used_kv_pages == p.num_cached_kv_pages and p.num_running == 0
        for p in info.processes
        if p.state == "READY"
    )


def test_a_sigkilled_gateways_requests_are_aborted_after_the_grace_window_and_a_connected_one_is_kept(
    stack: Stack, default_model_dir: Path
) -> None:
    texts = prompts(default_model_dir, NUM_VICTIMS + 1)
    watched = greedy(texts[-1], 24)
    expected = stack.generate(watched).token_ids
    metrics_before = [
        metric(stack, "specserve_gone_gateways_total"),
        metric(stack, "specserve_orphaned_requests_total"),
    ]
    with grpc.insecure_channel(start_gateway(stack, "gateway-b")) as channel:
        victim_gateway = pb_grpc.SpecServeStub(channel)

        # Connected and idle for longer than heartbeat timeout plus grace window: kept, by its heartbeats alone.
        time.sleep(HEARTBEAT_TIMEOUT_S + GRACE_S + 1.0)
        assert len(collect(victim_gateway.Generate(greedy(texts[0], 8), timeout=30)).token_ids) == 8
        assert events(stack, "gateway.missing", "gateway-b") == []

        threads, outcomes = stream_long_requests(victim_gateway, texts[:NUM_VICTIMS])
        wait_for(lambda: stack.info().num_running >= NUM_VICTIMS, 30, f"{NUM_VICTIMS} requests running", stack)
        watched_output: list[list[int]] = []
        watcher = threading.Thread(target=lambda: watched_output.append(stack.generate(watched).token_ids))
        watcher.start()  # through the gateway that stays, across the kill
        stack.processes["gateway-b"].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        time.sleep(GRACE_S / 4)
        num_running_within, within_s = stack.info().num_running, time.monotonic() - killed_at
        for thread in threads:
            thread.join(30)
    assert outcomes == ["StatusCode.UNAVAILABLE"] * NUM_VICTIMS  # their client saw its gateway go
    assert within_s < GRACE_S and num_running_within >= NUM_VICTIMS  # inside the window they run on: it may come back

    # The kill is seen within a tick (a probe finds the connection closed), the window runs, then a step ends.
    wait_for(
        lambda: is_idle(stack),
        killed_at + GRACE_S + 2.0 - time.monotonic(),
        "nothing running and every page free or cached",
        stack,
    )
    idle_after_s = time.monotonic() - killed_at
    assert idle_after_s >= GRACE_S
    watcher.join(30)
    assert watched_output == [expected]  # the other gateway's request: whole, token for token
    (gone,) = events(stack, "gateway.gone", "gateway-b")
    assert f"num_aborted={NUM_VICTIMS}" in gone and "because=disconnected" in gone, gone
    assert [metric(stack, "specserve_gone_gateways_total"), metric(stack, "specserve_orphaned_requests_total")] == [
        metrics_before[0] + 1,
        metrics_before[1] + NUM_VICTIMS,
    ]
    assert metric(stack, "specserve_gateways") == 1.0  # the stack's own gateway, still known
    print(
        f"\nSIGKILL of a gateway with {NUM_VICTIMS} requests running: idle {idle_after_s:.2f} s later "
        f"(--gateway-gone-grace-s {GRACE_S:g})"
    )


def test_a_gateway_silent_with_its_connection_up_has_its_requests_aborted_after_heartbeat_timeout_and_grace_window(
    stack: Stack, default_model_dir: Path
) -> None:
    with grpc.insecure_channel(start_gateway(stack, "gateway-c")) as channel:
        threads, outcomes = stream_long_requests(
            pb_grpc.SpecServeStub(channel), prompts(default_model_dir, NUM_VICTIMS)
        )
        wait_for(lambda: stack.info().num_running >= NUM_VICTIMS, 30, f"{NUM_VICTIMS} requests running", stack)
        process = stack.processes["gateway-c"]
        process.send_signal(signal.SIGSTOP)  # like a host gone without closing its connection: nothing more comes
        stopped_at = time.monotonic()
        try:
            wait_for(
                lambda: is_idle(stack),
                HEARTBEAT_TIMEOUT_S + GRACE_S + 2.0,
                "nothing running and every page free or cached",
                stack,
            )
            idle_after_s = time.monotonic() - stopped_at
        finally:
            process.kill()
            process.wait()
        for thread in threads:
            thread.join(30)
    assert outcomes == ["StatusCode.UNAVAILABLE"] * NUM_VICTIMS
    # Heard last at most a heartbeat interval before it stopped.
    assert idle_after_s >= HEARTBEAT_TIMEOUT_S + GRACE_S - m.GATEWAY_HEARTBEAT_INTERVAL_S
    (gone,) = events(stack, "gateway.gone", "gateway-c")
    assert f"num_aborted={NUM_VICTIMS}" in gone and "because=silent" in gone, gone
    print(
        f"\nSIGSTOP of a gateway with {NUM_VICTIMS} requests running: idle {idle_after_s:.2f} s later "
        f"(--heartbeat-timeout-s {HEARTBEAT_TIMEOUT_S:g}, --gateway-gone-grace-s {GRACE_S:g})"
    )
