"""Requests die with their gateway: one missing (connection closed, or silent) past the grace window has its requests
aborted and their pages freed; one that comes back in time, or keeps saying heartbeats, loses nothing.

The core is driven as the shell drives it: `on_gateway_unreachable` is what a send to a
closed connection reports (ROUTER_MANDATORY), `check_timeouts` the tick.
"""

from __future__ import annotations

import argparse
import asyncio

import pytest
import zmq
import zmq.asyncio

from gateway.scheduler_client import SchedulerClient
from proto import messages as m
from scheduler.config import add_arguments, from_arguments
from tests.unit.scheduler_fakes import DEFAULT_TOKEN, GATEWAY, Sim, assert_all_free

OTHER_GATEWAY = b"gateway-2"
GRACE_S = 2.0


def gateway_gone_sim() -> Sim:
    sim = Sim(gateway_gone_grace_s=GRACE_S)
    sim.gateway_heartbeats = False  # it went away: nothing more comes from it
    return sim


def submit_from(sim: Sim, identity: bytes, request_id: str, max_tokens: int = 40) -> None:
    submit = m.SubmitRequest(request_id, [100, 101, 102], max_tokens, m.SamplingParams(), [])
    sim.core.on_gateway_message(identity, submit, sim.now_s)
    sim.collect()


def test_a_disconnected_gateways_requests_run_through_the_grace_window_then_are_aborted_and_their_pages_freed() -> None:
    sim = gateway_gone_sim()
    worker = sim.worker("w0", num_kv_slots=2).start()
    for request_id in ("r1", "r2", "r3"):  # two run, one waits for a page
        sim.submit(request_id, max_tokens=40)
    worker.complete()
    sim.core.on_gateway_unreachable(GATEWAY, sim.now_s)  # a delta or a probe found its connection closed
    assert sim.core.gateways_to_probe() == []

    sim.advance(GRACE_S - 0.1)
    sim.check_timeouts()
    worker.complete()  # within the window it may come back: its requests run on
    assert (sim.core.num_running, sim.core.num_waiting, sim.errors()) == (2, 1, [])

    sim.advance(0.1)
    sim.check_timeouts()
    assert_all_free(sim, worker)
    assert not sim.core.knows_gateway(GATEWAY)
    errors = sim.errors()
    assert sorted(e.request_id for e in errors) == ["r1", "r2", "r3"]
    assert all(e.code == "UNAVAILABLE" and "--gateway-gone-grace-s" in e.message for e in errors)
    info = sim.info()
    assert (info.num_gateways, info.num_gone_gateways, info.num_orphaned_requests) == (0, 1, 3)
    worker.complete()  # the step that was in flight ends; nothing more is run for them
    assert worker.pending_step() is None and not sim.deltas("r1")[-1].finish_reason


def test_a_gateway_restarted_under_the_same_id_has_its_predecessors_requests_aborted_at_once() -> None:
    """The same identity (a fixed --gateway-id), a new process: it cannot resume what the old one ran."""
    sim = gateway_gone_sim()
    worker = sim.worker("w0").start()
    sim.core.on_gateway_message(GATEWAY, m.GatewayHello("gateway-1", m.PROTOCOL_VERSION, "first"), sim.now_s)
    sim.submit("r1", max_tokens=40)
    worker.complete()
    sim.core.on_gateway_message(GATEWAY, m.GatewayHeartbeat("gateway-1", m.PROTOCOL_VERSION, "first"), sim.now_s)
    assert sim.core.num_running == 1  # the same process: nothing changes
    sim.core.on_gateway_message(GATEWAY, m.GatewayHello("gateway-1", m.PROTOCOL_VERSION, "second"), sim.now_s)
    worker.complete()
    assert_all_free(sim, worker)
    assert sim.core.knows_gateway(GATEWAY) and sim.info().num_orphaned_requests == 1
    assert not sim.errors()  # (the new process never knew r1: nothing is sent to it)
    sim.submit("r2", max_tokens=3)  # the new process is served
    worker.run()
    assert sim.finish_reason("r2") == "length"


def test_a_gateway_back_within_the_grace_window_keeps_its_requests() -> None:
    sim = gateway_gone_sim()
    worker = sim.worker("w0").start()
    sim.submit("r1", max_tokens=6)
    worker.complete()
    sim.core.on_gateway_unreachable(GATEWAY, sim.now_s)
    sim.advance(GRACE_S - 0.5)
    sim.check_timeouts()
    sim.core.on_gateway_message(GATEWAY, m.GatewayHello("gateway-1", m.PROTOCOL_VERSION), sim.now_s)  # reconnected
    assert sim.core.gateways_to_probe() == [GATEWAY]
    sim.advance(GRACE_S)
    sim.check_timeouts()
    worker.run()
    assert sim.streamed("r1") == [DEFAULT_TOKEN] * 6 and sim.finish_reason("r1") == "length" and not sim.errors()
    assert sim.info().num_gone_gateways == 0


def test_a_silent_gateway_is_missing_after_the_heartbeat_timeout_and_gone_a_grace_window_later() -> None:
    sim = gateway_gone_sim()  # connected, but says nothing: a host gone without closing its connection, a hung process
    worker = sim.worker("w0").start()
    sim.submit("r1", max_tokens=40)  # heard last now
    silent_s = sim.config.heartbeat_timeout_s + GRACE_S

    sim.advance(silent_s - 0.1)
    worker.heartbeat()  # the worker is alive
    sim.check_timeouts()
    assert sim.core.num_running == 1 and sim.core.gateways_to_probe() == []  # missing: not probed any more

    sim.advance(0.1)
    worker.heartbeat()
    sim.check_timeouts()
    assert_all_free(sim, worker)
    assert [e.request_id for e in sim.errors()] == ["r1"] and "silent" in sim.errors()[0].message


def test_a_gateway_that_says_heartbeats_is_never_given_up_on_even_idle_far_past_the_window() -> None:
    sim = Sim(gateway_gone_grace_s=GRACE_S)  # its heartbeats come as time passes
    worker = sim.worker("w0").start()
    for _ in range(30):
        sim.advance(1.0)
        worker.heartbeat()
        sim.check_timeouts()
    assert sim.core.knows_gateway(GATEWAY) and sim.core.gateways_to_probe() == [GATEWAY]
    sim.submit("r1", max_tokens=3)
    worker.run()
    assert sim.finish_reason("r1") == "length" and sim.info().num_gone_gateways == 0


def test_only_the_gone_gateways_requests_are_aborted() -> None:
    sim = Sim(gateway_gone_grace_s=GRACE_S)
    worker = sim.worker("w0").start()
    sim.core.on_gateway_message(OTHER_GATEWAY, m.GatewayHello("gateway-2", m.PROTOCOL_VERSION), sim.now_s)
    submit_from(sim, OTHER_GATEWAY, "theirs")
    sim.submit("mine", max_tokens=8)
    worker.complete()
    sim.core.on_gateway_unreachable(OTHER_GATEWAY, sim.now_s)
    sim.advance(GRACE_S)
    sim.check_timeouts()
    assert [e.request_id for e in sim.errors()] == ["theirs"]
    worker.run()
    assert sim.streamed("mine") == [DEFAULT_TOKEN] * 8 and sim.finish_reason("mine") == "length"
    assert_all_free(sim, worker)
    assert sim.core.knows_gateway(GATEWAY) and not sim.core.knows_gateway(OTHER_GATEWAY)


def test_a_gone_gateway_is_known_again_from_its_next_heartbeat() -> None:
    sim = gateway_gone_sim()
    sim.core.on_gateway_unreachable(GATEWAY, sim.now_s)
    sim.advance(GRACE_S)
    sim.check_timeouts()
    assert not sim.core.knows_gateway(GATEWAY) and sim.info().num_gone_gateways == 1
    # It had only hung, its connection up: its heartbeats resume, and so does the service it gets.
    sim.core.on_gateway_message(GATEWAY, m.GatewayHeartbeat("gateway-1", m.PROTOCOL_VERSION), sim.now_s)
    assert sim.core.knows_gateway(GATEWAY) and sim.core.gateways_to_probe() == [GATEWAY]


def test_a_gateway_speaking_another_protocol_version_is_not_known() -> None:
    sim = Sim()
    for greeting in (m.GatewayHello("gateway-2", m.PROTOCOL_VERSION - 1), m.GatewayHeartbeat("gateway-2", 999)):
        sim.core.on_gateway_message(OTHER_GATEWAY, greeting, sim.now_s)
    assert not sim.core.knows_gateway(OTHER_GATEWAY)
    assert sim.info().protocol_errors["gateway.bad_hello"] == 2


@pytest.mark.parametrize(
    ("argv", "expected"), [([], 10.0), (["--gateway-gone-grace-s", "0"], 0.0), (["--gateway-gone-grace-s", "-1"], None)]
)
def test_the_grace_window_flag(argv: list[str], expected: float | None) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([*argv, "--insecure-loopback"])
    if expected is None:
        with pytest.raises(ValueError, match="--gateway-gone-grace-s"):
            from_arguments(args)
    else:
        assert from_arguments(args).gateway_gone_grace_s == expected


def test_the_gateways_scheduler_client_says_heartbeats_and_takes_probes_as_nothing() -> None:
    async def scenario() -> None:
        context = zmq.asyncio.Context()
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        client = SchedulerClient(f"tcp://127.0.0.1:{port}", "gw-heartbeat", reply_timeout_s=1.0)
        codec_in: m.Codec[m.GatewayToScheduler] = m.Codec(m.GatewayToScheduler)
        await client.connect()
        running = asyncio.create_task(client.run())
        try:
            async with asyncio.timeout(5 * m.GATEWAY_HEARTBEAT_INTERVAL_S):
                received: list[m.GatewayToScheduler] = []
                while not any(isinstance(x, m.GatewayHeartbeat) for x in received):
                    identity, frame = await router.recv_multipart()
                    received.append(codec_in.decode(frame))
            assert identity == b"gw-heartbeat"
            hello, heartbeat = received[0], received[-1]
            assert hello == m.GatewayHello("gw-heartbeat", m.PROTOCOL_VERSION, hello.incarnation)
            assert heartbeat == m.GatewayHeartbeat("gw-heartbeat", m.PROTOCOL_VERSION, hello.incarnation)
            assert len(hello.incarnation) == 16  # the process's own
            for _ in range(3):
                await router.send_multipart([identity, m.Codec(m.SchedulerToGateway).encode(m.Probe())])
            await asyncio.sleep(0.2)
            assert client.protocol_errors.total == 0 and client.num_dropped_messages == 0
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            client.close()
            context.destroy(linger=0)

    asyncio.run(scenario())
