"""Messages from something that reached the scheduler's ZeroMQ sockets, against a real stack.

A raw ZeroMQ client without the stack's keys is refused in the CURVE handshake: nothing it
sends arrives. One that holds them (a compromised process, a stolen key) plays a second
gateway and a process posing as a worker. Each of its messages is refused and counted; no
process crashes or restarts, the users' output does not change, and the stack keeps serving.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.auth
import zmq.utils.monitor

from common.transport import Role, Transport
from proto import frames
from proto import messages as m
from proto import specserve_pb2 as pb
from proto.lifecycle import State
from tests.e2e.stack import Stack
from tests.e2e.test_reliability import greedy, run_all

PROMPT = list(range(300, 340))


class RawPeer:
    """A DEALER on one of the scheduler's sockets holding the stack's key for it, speaking the protocol with no
    process behind it."""

    def __init__(self, stack: Stack, role: Role) -> None:
        self.context = zmq.Context()
        self.socket = stack.insider(self.context, role)
        self.decoder = msgspec.msgpack.Decoder(m.SchedulerToGateway if role == "gateway" else m.SchedulerToWorker)

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
    peer = RawPeer(stack, "gateway")
    peer.send(m.GatewayHello("second-gateway", m.PROTOCOL_VERSION))
    return peer


def _plausible_hello(worker_id: str, incarnation: int, **overrides: object) -> m.WorkerHello:
    """A target's hello as a real one would look, but for `overrides`."""
    fields: dict[str, object] = dict(
        worker_id=worker_id,
        role="target",
        incarnation=incarnation,
        protocol_version=m.PROTOCOL_VERSION,
        pid=1,
        model_name="SmolLM2-135M-Instruct",
        model_fingerprint="x",
        vocab_size=49152,
        max_model_len=2048,
        num_kv_pages=64,
        kv_page_size=16,
        dtype="float32",
        device="cpu",
    )
    return m.WorkerHello(**{**fields, **overrides})  # type: ignore[arg-type]


def _refusals(gateway: RawPeer) -> dict[str, int]:
    # A raw peer says no heartbeats of its own: silent past the scheduler's timeout and grace window, it would be
    # forgotten, and its query dropped. One now keeps it known, however long the test waited.
    gateway.send(m.GatewayHeartbeat("second-gateway", m.PROTOCOL_VERSION))
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
    fp32_stack: Stack,
) -> None:
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


def test_a_gateways_submit_the_scheduler_cannot_read_is_answered_never_left_waiting(fp32_stack: Stack) -> None:
    """What the attack run's hangs were: a float where the seed's integer belongs. The gateway checks its own
    submits first; the scheduler answers any that still comes, naming the field."""
    gateway = _gateway(fp32_stack)
    try:
        submit = msgspec.to_builtins(m.SubmitRequest("unreadable-1", [100, 101], 4, m.SamplingParams(), []))
        submit["sampling"]["seed"] = 1.5
        gateway.socket.send(msgspec.msgpack.encode({"type": "submit", **submit}))
        error = gateway.receive(m.RequestError)
        assert isinstance(error, m.RequestError) and error.request_id == "unreadable-1"
        assert error.code == "INVALID_ARGUMENT" and "$.sampling.seed" in error.message
        gateway.socket.send(msgspec.msgpack.encode({"type": "submit", "request_id": 7}))  # no id to answer: dropped
        assert _refusals(gateway).get("gateway.decode", 0) >= 2
    finally:
        gateway.close()
    assert fp32_stack.generate(greedy(PROMPT, 4)).token_ids


def test_hellos_and_reports_posing_as_a_worker_are_refused_and_the_real_worker_serves_on(fp32_stack: Stack) -> None:
    before_output = fp32_stack.generate(greedy(PROMPT, 16)).token_ids
    before = _targets(fp32_stack)
    real = _target(fp32_stack)
    assert "linear kernel" in real.kernels or real.kernels.startswith("torch ("), real.kernels  # as it said when READY
    gateway = _gateway(fp32_stack)
    impostor = RawPeer(fp32_stack, "worker")
    try:
        refused_before = _refusals(gateway)
        hello = _plausible_hello("evil", time.time_ns(), num_kv_pages=2**62)
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
    assert _target(fp32_stack).kernels == real.kernels
    assert "evil" not in {p.process_id for p in fp32_stack.info().processes}


def test_a_second_gateway_cannot_abort_anothers_request(fp32_stack: Stack) -> None:
    expected = fp32_stack.generate(greedy(PROMPT, 160)).token_ids
    request = greedy(PROMPT, 160)  # long enough to be running when the forged abort comes
    request.request_id = f"victim-{time.monotonic_ns()}"
    streamed: list[list[int]] = []
    user = threading.Thread(target=lambda: streamed.append(fp32_stack.generate(request).token_ids))
    user.start()
    gateway = _gateway(fp32_stack)
    try:
        refused_before = _refusals(gateway).get("gateway.not_owner", 0)
        # The scheduler knows the victim by its gateway's id for it (what an attacker with a gateway key might learn).
        victim_id = _scheduler_id(fp32_stack, request.request_id)
        gateway.send(m.AbortRequest(victim_id, "forged"))
        user.join(timeout=120)
        assert _refusals(gateway).get("gateway.not_owner", 0) >= refused_before + 1
    finally:
        gateway.close()
    assert streamed == [expected]  # finished, whole, and its owner heard the end


def _scheduler_id(stack: Stack, request_id: str, timeout_s: float = 10.0) -> str:
    """The id the stack's gateway submitted the client's request under, from its `request.submitted` log line."""
    deadline = time.monotonic() + timeout_s
    while True:
        for line in (stack.log_dir / "gateway.log").read_text(errors="replace").splitlines():
            if "request.submitted" in line and f"request_id={request_id} " in line:
                return line.split("scheduler_id=")[1].split()[0]
        assert time.monotonic() < deadline, f"no request.submitted line for {request_id}"
        time.sleep(0.05)


def _refusals_grow(
    gateway: RawPeer, before: dict[str, int], kinds: list[str], timeout_s: float = 10.0
) -> dict[str, int]:
    """The refusal counters once each of `kinds` has grown past `before`."""
    deadline = time.monotonic() + timeout_s
    while True:
        refused = _refusals(gateway)
        if all(refused.get(kind, 0) > before.get(kind, 0) for kind in kinds):
            return refused
        assert time.monotonic() < deadline, (kinds, refused)
        time.sleep(0.2)


def _knock(sock: zmq.Socket[bytes], message: msgspec.Struct) -> None:
    """An outsider's message, sent without waiting: while its refused handshake is torn down and retried the socket
    has no peer to queue for, and a blocking send would wait there for good (what the scheduler refuses is the
    handshake, whether or not the message got queued)."""
    try:
        sock.send(msgspec.msgpack.encode(message), zmq.NOBLOCK)
    except zmq.Again:
        pass


def test_peers_without_the_stacks_keys_are_refused_in_the_handshake_and_a_fake_worker_never_registers(
    fp32_stack: Stack,
) -> None:
    assert fp32_stack.config.keys is not None
    before_output = fp32_stack.generate(greedy(PROMPT, 16)).token_ids
    before = _targets(fp32_stack)
    gateway = _gateway(fp32_stack)
    context = zmq.Context()
    outsiders: dict[Role, list[zmq.Socket[bytes]]] = {"gateway": [], "worker": []}
    try:
        refused_before = _refusals(gateway)
        scheduler_key, _ = zmq.auth.load_certificate(fp32_stack.config.keys / "scheduler.key")
        for role, address in (
            ("gateway", fp32_stack.addresses.gateway_address),
            ("worker", fp32_stack.addresses.worker_address),
        ):
            plain = context.socket(zmq.DEALER)  # no CURVE at all
            stranger = context.socket(zmq.DEALER)  # CURVE with the right server key, but a key of its own
            stranger.curve_serverkey = scheduler_key
            stranger.curve_publickey, stranger.curve_secretkey = zmq.curve_keypair()
            for sock in (plain, stranger):
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(address)
                outsiders[role].append(sock)
        incarnation = time.time_ns()
        hello = _plausible_hello("fake-worker", incarnation)
        phases = [State.STARTING, State.LOADING, State.ALLOCATING, State.WARMING, State.READY]
        for sock in outsiders["worker"]:  # a whole fake worker: its hello and every report up to READY
            _knock(sock, hello)
            for previous, state in zip(phases, phases[1:], strict=False):
                _knock(sock, m.LifecycleReport("fake-worker", incarnation, state, previous, 0.1))
        for sock in outsiders["gateway"]:
            _knock(sock, m.GatewayHello("outsider", m.PROTOCOL_VERSION))
            _knock(sock, m.SubmitRequest("outsider-1", PROMPT, 4, m.SamplingParams(), []))
        refused = _refusals_grow(
            gateway,
            refused_before,
            [
                "gateway.handshake_failed",
                "gateway.unauthorized_key",
                "worker.handshake_failed",
                "worker.unauthorized_key",
            ],
        )
        # Users' requests are served while the outsiders keep knocking (ZeroMQ retries their handshakes).
        assert fp32_stack.generate(greedy(PROMPT, 16)).token_ids == before_output
        assert all(not sock.poll(0) for socks in outsiders.values() for sock in socks)  # nothing came back
    finally:
        for socks in outsiders.values():
            for sock in socks:
                sock.close()
        context.term()
        gateway.close()
    assert "fake-worker" not in {p.process_id for p in fp32_stack.info().processes}
    assert _targets(fp32_stack) == before
    log = (fp32_stack.log_dir / "scheduler.log").read_text()
    assert "unauthorized_key" in log and "handshake_failed" in log
    print(f"\nrefused in the handshake: { {k: v for k, v in refused.items() if 'handshake' in k or 'key' in k} }")


def test_a_hello_with_a_live_workers_id_is_refused_and_the_newcomer_told_to_stop(fp32_stack: Stack) -> None:
    before_output = fp32_stack.generate(greedy(PROMPT, 16)).token_ids
    before = _targets(fp32_stack)
    real = _target(fp32_stack)
    gateway = _gateway(fp32_stack)
    impostor = RawPeer(fp32_stack, "worker")
    try:
        refused_before = _refusals(gateway)
        incarnation = time.time_ns()  # newer than the real one's, and plausible
        impostor.send(_plausible_hello(real.process_id, incarnation))
        drain = impostor.receive(m.Drain)
        assert isinstance(drain, m.Drain) and drain.incarnation == incarnation
        impostor.send(m.LifecycleReport(real.process_id, incarnation, State.LOADING, State.STARTING, 0.1))
        refused = _refusals_grow(gateway, refused_before, ["worker.duplicate_id"])
        assert fp32_stack.generate(greedy(PROMPT, 16)).token_ids == before_output
    finally:
        impostor.close()
        gateway.close()
    assert _targets(fp32_stack) == before  # the real worker: same incarnation, READY, never dismissed
    assert "worker.duplicate_refused" in (fp32_stack.log_dir / "scheduler.log").read_text()
    print(f"\nduplicate id refused: {refused['worker.duplicate_id']}")


def test_a_connection_claiming_a_live_workers_routing_identity_neither_takes_its_route_nor_speaks_for_it(
    fp32_stack: Stack,
) -> None:
    before_output = fp32_stack.generate(greedy(PROMPT, 16)).token_ids
    before = _targets(fp32_stack)
    real = _target(fp32_stack)
    context = zmq.Context()
    thief = context.socket(zmq.DEALER)
    thief.setsockopt(zmq.IDENTITY, m.worker_identity(real.process_id, real.incarnation))  # public: id and incarnation
    thief.setsockopt(zmq.LINGER, 0)
    Transport(fp32_stack.config.keys).join(thief, "worker")
    thief.connect(fp32_stack.addresses.worker_address)
    try:
        thief.send(
            msgspec.msgpack.encode(
                m.WorkerFailed(real.process_id, real.incarnation, State.READY, "RuntimeError", "forged")
            )
        )
        # Steps for the real worker still reach it: a taken-over route would deliver them here instead.
        assert run_all(fp32_stack, [greedy(PROMPT, 16) for _ in range(8)]) == [before_output] * 8
        after = fp32_stack.process_info(real.process_id)
        assert after is not None and after.prefix_cache_queried_tokens > real.prefix_cache_queried_tokens  # it ran some
        assert not thief.poll(500)
    finally:
        thief.close()
        context.term()
    assert _targets(fp32_stack) == before


# A ZMTP 3.0 greeting (rfc.zeromq.org/spec/23) as a CURVE client sends it: signature, version, mechanism, as-server 0.
_GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\x00") + b"\x00" + bytes(31)
_GIB = 1 << 30


def _rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))


def _stream_huge_frame(address: str, rss: list[int], pid: int) -> tuple[int, float]:
    """Greet the scheduler's socket at `address` as a CURVE client would, then announce a command frame of 1 GiB and
    stream zeros until the connection drops, sampling the scheduler's RSS into `rss`. Returns (bytes of the frame's
    body sent, seconds until the drop)."""
    host_port = urlsplit(address.replace("tcp://", "//"))
    chunk = bytes(1 << 20)
    with socket.create_connection((host_port.hostname, host_port.port), timeout=10) as raw:
        raw.sendall(_GREETING)
        greeting = b""
        while len(greeting) < len(_GREETING):
            greeting += raw.recv(len(_GREETING) - len(greeting))
        assert greeting.startswith(b"\xff") and b"CURVE" in greeting, greeting
        raw.sendall(bytes([0x06]) + struct.pack(">Q", _GIB))  # a long command frame: flags, then its 8-byte size
        started, sent = time.monotonic(), 0
        try:
            while sent < _GIB:
                raw.sendall(chunk)
                sent += len(chunk)
                rss.append(_rss_kib(pid))
        except OSError:  # reset or broken pipe: the scheduler dropped the connection
            return sent, time.monotonic() - started
    raise AssertionError(f"the scheduler took a whole 1 GiB frame on {address} from a peer without a key")


def test_a_huge_frame_from_a_peer_without_keys_is_dropped_at_its_header_while_users_are_served(
    fp32_stack: Stack,
) -> None:
    """A raw TCP peer greets the scheduler and announces a 1 GiB frame on each socket: the scheduler reads the size,
    over its bound (proto/frames.py), and drops the connection before holding any of it."""
    pid = fp32_stack.processes["scheduler"].pid
    before_output = fp32_stack.generate(greedy(PROMPT, 16)).token_ids
    before = _targets(fp32_stack)
    rss = [_rss_kib(pid)]
    streamed: list[list[int]] = []
    user = threading.Thread(target=lambda: streamed.append(fp32_stack.generate(greedy(PROMPT, 64)).token_ids))
    user.start()
    drops = {
        name: _stream_huge_frame(address, rss, pid)
        for name, address in (
            ("gateway", fp32_stack.addresses.gateway_address),
            ("worker", fp32_stack.addresses.worker_address),
        )
    }
    user.join(timeout=120)
    time.sleep(0.5)
    rss.append(_rss_kib(pid))
    for name, (sent, seconds) in drops.items():
        assert seconds < 2.0 and sent <= 64 << 20, (name, sent, seconds)  # what the kernel's buffers took, at most
    assert max(rss) - rss[0] < 8 * 1024, rss  # KiB: within a few MB of before
    assert streamed == [fp32_stack.generate(greedy(PROMPT, 64)).token_ids]
    assert fp32_stack.generate(greedy(PROMPT, 16)).token_ids == before_output
    assert _targets(fp32_stack) == before
    print(
        f"\nscheduler RSS {rss[0] / 1024:.1f} MiB before, {max(rss) / 1024:.1f} MiB at most while 1 GiB frames were "
        f"announced; dropped after "
        f"{', '.join(f'{n}: {s >> 20} MiB in {t * 1000:.0f} ms' for n, (s, t) in drops.items())}"
    )


def test_a_frame_over_the_bound_from_a_peer_with_a_key_drops_its_connection_and_the_scheduler_serves_on(
    fp32_stack: Stack,
) -> None:
    before_output = fp32_stack.generate(greedy(PROMPT, 16)).token_ids
    context = zmq.Context()
    peer = context.socket(zmq.DEALER)  # the stack's gateway key: its handshake succeeds
    peer.setsockopt(zmq.LINGER, 0)
    Transport(fp32_stack.config.keys).join(peer, "gateway")
    monitor = peer.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)  # before connecting
    peer.connect(fp32_stack.addresses.gateway_address)
    try:

        def next_event(timeout_s: float = 10.0) -> int:
            assert monitor.poll(int(timeout_s * 1000)), "no event from the peer's socket"
            return int(zmq.utils.monitor.parse_monitor_message(monitor.recv_multipart())["event"])

        peer.send(msgspec.msgpack.encode(m.GatewayHello("oversized", m.PROTOCOL_VERSION)))
        assert next_event() == zmq.EVENT_HANDSHAKE_SUCCEEDED
        bound = frames.gateway_to_scheduler(fp32_stack.config.max_model_len)
        peer.send(bytes(bound + 1))
        assert next_event() == zmq.EVENT_DISCONNECTED  # at the frame's header: nothing of it was read
        assert fp32_stack.generate(greedy(PROMPT, 16)).token_ids == before_output
    finally:
        monitor.close()
        peer.close()
        context.term()
