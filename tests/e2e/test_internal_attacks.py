"""Well-formed messages from something that reached the scheduler's ZeroMQ sockets, against a real stack.

A raw ZeroMQ client plays a second gateway and a process posing as a worker. Each of its
messages is refused and counted; no process crashes or restarts, the users' output does
not change, and the stack keeps serving.
"""

from __future__ import annotations

import threading
import time

import msgspec
import zmq

from proto import messages as m
from proto import specserve_pb2 as pb
from proto.lifecycle import State
from tests.e2e.stack import Stack
from tests.e2e.test_reliability import greedy

PROMPT = list(range(300, 340))


class RawPeer:
    """A DEALER on one of the scheduler's sockets, speaking the protocol with no process behind it."""

    def __init__(self, address: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.decoder = msgspec.msgpack.Decoder(m.SchedulerToGateway)

    def send(self, message: msgspec.Struct) -> None:
        self.socket.send(msgspec.msgpack.encode(message))

    def receive(self, kind: type, timeout_s: float = 10.0) -> msgspec.Struct:
        """The next message of `kind` the scheduler sends here (others skipped)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if self.socket.poll(int(left * 1000)):
                message = self.decoder.decode(self.socket.recv())
                if isinstance(message, kind):
                    return message
        raise AssertionError(f"no {kind.__name__} within {timeout_s} s")

    def close(self) -> None:
        self.socket.close()
        self.context.term()


def _gateway(stack: Stack) -> RawPeer:
    peer = RawPeer(stack.addresses.gateway_address)
    peer.send(m.GatewayHello("second-gateway", m.PROTOCOL_VERSION))
    return peer


def _refusals(gateway: RawPeer) -> dict[str, int]:
    gateway.send(m.InfoQuery(query_id=77))
    reply = gateway.receive(m.InfoReply)
    assert isinstance(reply, m.InfoReply)
    return reply.protocol_errors


def _targets(stack: Stack) -> dict[str, tuple[int, str]]:
    """Every target worker listed: (incarnation, state) by id."""
    return {p.process_id: (p.incarnation, p.state) for p in stack.info().processes if p.role == "target"}


def _target(stack: Stack) -> pb.Process:
    return next(p for p in stack.info().processes if p.role == "target" and p.state == "READY")


def test_a_second_gateways_request_with_ids_outside_the_vocabulary_is_refused_and_nothing_restarts(
        fp32_stack: Stack) -> None:
    before_output = fp32_stack.generate(greedy(PROMPT, 16)).token_ids
    before = _targets(fp32_stack)
    gateway = _gateway(fp32_stack)
    try:
        gateway.send(m.SubmitRequest("poison-1", [100, 1 << 30, 101], 4, m.SamplingParams(), []))
        error = gateway.receive(m.RequestError)
        assert isinstance(error, m.RequestError) and error.code == "INVALID_ARGUMENT"
        assert "prompt_token_ids holds 1073741824" in error.message
        gateway.send(m.SubmitRequest("poison-2", [100], 4, m.SamplingParams(temperature=1.0, top_p=0.0), []))
        error = gateway.receive(m.RequestError)
        assert isinstance(error, m.RequestError) and "top_p" in error.message
    finally:
        gateway.close()
    assert _targets(fp32_stack) == before
    assert fp32_stack.generate(greedy(PROMPT, 16)).token_ids == before_output


def test_hellos_and_reports_posing_as_a_worker_are_refused_and_the_real_worker_serves_on(fp32_stack: Stack) -> None:
    before_output = fp32_stack.generate(greedy(PROMPT, 16)).token_ids
    before = _targets(fp32_stack)
    real = _target(fp32_stack)
    gateway = _gateway(fp32_stack)
    impostor = RawPeer(fp32_stack.addresses.worker_address)
    try:
        refused_before = _refusals(gateway)
        hello = m.WorkerHello(worker_id="evil", role="target", incarnation=time.time_ns(),
                              protocol_version=m.PROTOCOL_VERSION, pid=1, model_name="x", model_fingerprint="x",
                              vocab_size=49152, max_model_len=2048, num_kv_pages=2**62, kv_page_size=16,
                              dtype="float32", device="cpu")
        impostor.send(hello)  # a page pool of 2^62 pages was a MemoryError that took the scheduler down
        impostor.send(msgspec.structs.replace(hello, worker_id=real.process_id, incarnation=2**62, num_kv_pages=64))
        impostor.send(m.WorkerFailed(real.process_id, real.incarnation, State.READY, "RuntimeError", "forged"))
        # While a user's request streams, the impostor also reports results for the real worker's steps.
        streamed: list[list[int]] = []
        user = threading.Thread(target=lambda: streamed.append(fp32_stack.generate(greedy(PROMPT, 16)).token_ids))
        user.start()
        for step_id in range(1, 2000, 7):
            impostor.send(m.StepResult(real.process_id, real.incarnation, step_id, [], duration_ms=1.0))
        user.join(timeout=120)
        deadline = time.monotonic() + 10
        while (refused := _refusals(gateway)).get("worker.not_owner", 0) <= refused_before.get("worker.not_owner", 0):
            assert time.monotonic() < deadline, refused
            time.sleep(0.2)
        assert refused["worker.bad_hello"] >= refused_before.get("worker.bad_hello", 0) + 2
    finally:
        impostor.close()
        gateway.close()
    assert streamed == [before_output]
    assert _targets(fp32_stack) == before
    assert "evil" not in {p.process_id for p in fp32_stack.info().processes}


def test_a_second_gateway_cannot_abort_anothers_request(fp32_stack: Stack) -> None:
    expected = fp32_stack.generate(greedy(PROMPT, 160)).token_ids
    request = greedy(PROMPT, 160)  # long enough to be running when the forged abort comes
    request.request_id = "victim-request"
    streamed: list[list[int]] = []
    user = threading.Thread(target=lambda: streamed.append(fp32_stack.generate(request).token_ids))
    user.start()
    gateway = _gateway(fp32_stack)
    try:
        refused_before = _refusals(gateway).get("gateway.not_owner", 0)
        time.sleep(0.3)  # the victim is queued or running by now
        gateway.send(m.AbortRequest("victim-request", "forged"))
        user.join(timeout=120)
        assert _refusals(gateway).get("gateway.not_owner", 0) >= refused_before + 1
    finally:
        gateway.close()
    assert streamed == [expected]  # finished, whole, and its owner heard the end
