"""Malformed messages at both of the scheduler's sockets while it serves: counted, logged once, dropped.

Each socket gets at least 1,000 hypothesis-generated frames (see tests/fuzz_frames.py)
from senders that never said hello, and from one that did, while a greedy request
streams; afterwards the stack still gives exactly the output it gave before.
"""

from __future__ import annotations

import threading
import time

import msgspec
import zmq
from hypothesis import HealthCheck, given, settings

from proto import messages as m
from tests.e2e.stack import Stack
from tests.e2e.test_reliability import greedy
from tests.fuzz_frames import malformed_frames
from tests.unit.test_messages import (
    GATEWAY_TO_SCHEDULER,
    SCHEDULER_TO_DRAFT,
    SCHEDULER_TO_GATEWAY,
    SCHEDULER_TO_WORKER,
    WORKER_TO_SCHEDULER,
)

FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), database=None)

# Well-formed messages a fuzzer must not send:
# a hello (or a gateway's heartbeat) would make it a real gateway or worker.
GATEWAY_SIDE = [x for x in GATEWAY_TO_SCHEDULER if not isinstance(x, m.GatewayHello | m.GatewayHeartbeat)]
WORKER_SIDE = [x for x in WORKER_TO_SCHEDULER if not isinstance(x, m.WorkerHello)]


def test_the_scheduler_drops_malformed_frames_on_both_sockets_and_serves_on(fp32_stack: Stack) -> None:
    request = greedy(list(range(100, 130)), 24)
    before = fp32_stack.generate(request).token_ids
    context = zmq.Context()
    # Each holds the stack's keys: what is fuzzed is what comes after the handshake.
    anonymous = fp32_stack.insider(context, "gateway")  # never says hello
    greeted = fp32_stack.insider(context, "gateway")  # says hello, then sends garbage
    greeted.send(msgspec.msgpack.encode(m.GatewayHello("fuzz-gateway", m.PROTOCOL_VERSION)))
    worker_side = fp32_stack.insider(context, "worker")
    for sock in (anonymous, greeted, worker_side):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
    during: list[list[int]] = []
    streaming = threading.Thread(target=lambda: during.append(fp32_stack.generate(request).token_ids))
    streaming.start()
    sent = {"gateway": 0, "worker": 0}

    others = [*SCHEDULER_TO_GATEWAY, *SCHEDULER_TO_WORKER, *WORKER_TO_SCHEDULER]

    @FUZZ
    @given(malformed_frames(GATEWAY_SIDE, others), malformed_frames(GATEWAY_SIDE, others, mutate=False))
    def at_gateway_socket(from_anonymous: bytes, from_greeted: bytes) -> None:
        anonymous.send(from_anonymous)
        greeted.send(from_greeted)  # never a mutated message: one could be a valid submit from a real gateway
        sent["gateway"] += 1

    @FUZZ
    @given(malformed_frames(WORKER_SIDE, [*SCHEDULER_TO_WORKER, *SCHEDULER_TO_DRAFT, *GATEWAY_TO_SCHEDULER]))
    def at_worker_socket(frame: bytes) -> None:
        worker_side.send(frame)
        sent["worker"] += 1

    try:
        at_gateway_socket()
        at_worker_socket()
        worker_side.send_multipart([b"one", b"frame", b"too many"])
        anonymous.send_multipart([b"", b""])
        streaming.join(120)
        assert sent["gateway"] >= 1000 and sent["worker"] >= 1000
        assert during == [before]
        assert fp32_stack.generate(request).token_ids == before
        info = fp32_stack.info()
        assert sorted(p.process_id for p in info.processes) == ["worker-0", "worker-1"]  # no fuzzer registered
        assert all(p.state == "READY" for p in info.processes)
        # The scheduler reads each socket on its own: the last frames sent may still be queued; wait for them.
        kinds = ("decode", "unknown_sender", "stale_or_unexpected", "frames")
        deadline = time.monotonic() + 60
        while missing := [k for k in kinds if f"kind={k}" not in (fp32_stack.log_dir / "scheduler.log").read_text()]:
            assert time.monotonic() < deadline, f"never logged: {missing}"
            time.sleep(0.2)
    finally:
        context.destroy(linger=0)
