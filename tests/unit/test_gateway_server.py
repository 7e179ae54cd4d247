"""The gateway in-process over real sockets: gRPC client -> servicer -> SchedulerClient -> a scripted fake scheduler."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import zmq
import zmq.asyncio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.logs import configure
from gateway.app import add_services
from gateway.generation import Generation
from gateway.health import HealthReporter
from gateway.metrics import GatewayMetrics
from gateway.scheduler_client import SchedulerClient
from gateway.server import SpecServeServicer
from common.text.tokenizer import ChatMessage, Tokenizer
from proto import messages as m
from proto.lifecycle import State
from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parents[2]
Script = Callable[[m.SubmitRequest], Sequence[m.SchedulerToGateway]]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.load(default_model_dir)


@pytest.fixture(scope="module", autouse=True)
def logs_to_stderr() -> None:
    """Gateway logs go to stderr, as in the process, so stdout holds only what the CLI prints."""
    configure("gateway-test")


@pytest.fixture(scope="module")
def run() -> Iterator[Callable[[Awaitable[T]], T]]:
    """One event loop for the module: grpc.aio keeps per-loop state."""
    with asyncio.Runner() as runner:
        yield runner.run  # type: ignore[misc]


def ready_target(state: str = "READY") -> m.ProcessInfo:
    return m.ProcessInfo(
        process_id="worker-0",
        role="target",
        state=State(state),
        incarnation=2**62,  # incarnations can be large: int64 on the wire
        heartbeat_age_s=0.25,
        num_used_kv_pages=1,
        num_kv_pages=8,
        kv_page_size=16,
        num_running=1,
        failure="",
        protocol_errors={"decode": 1},  # in /metrics only: GetServerInfo has no field for it
        kernels="native (linear kernel: avx2; 120 weights from q4_1 blocks)",
        batch_invariant=True,
    )


def deltas(
    request_id: str, token_ids: Sequence[int], finish: m.FinishReason | None, num_prompt: int
) -> list[m.TokenDelta]:
    """One TokenDelta per token; the last has `finish`."""
    return [
        m.TokenDelta(request_id, [token_id], finish if index == len(token_ids) - 1 else None, num_prompt, index + 1)
        for index, token_id in enumerate(token_ids)
    ]


class FakeScheduler:
    """A ROUTER that answers like the scheduler: hello, info queries, and a scripted reply to each submit."""

    def __init__(self, script: Script, *, delay_s: float = 0.0) -> None:
        self.script = script
        self.delay_s = delay_s  # between two messages of one request
        self.answer_info = True
        self.processes = [ready_target()]
        self.received: list[m.GatewayToScheduler] = []
        self.aborts: dict[str, str] = {}
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{self.port}"
        self._codec_in: m.Codec[m.GatewayToScheduler] = m.Codec(m.GatewayToScheduler)
        self._codec_out: m.Codec[m.SchedulerToGateway] = m.Codec(m.SchedulerToGateway)
        self._tasks: set[asyncio.Task[None]] = set()
        self.gateway_identity = b""

    def submits(self) -> list[m.SubmitRequest]:
        return [message for message in self.received if isinstance(message, m.SubmitRequest)]

    def hellos(self) -> list[m.GatewayHello]:
        return [message for message in self.received if isinstance(message, m.GatewayHello)]

    async def run(self) -> None:
        while True:
            identity, frame = await self.socket.recv_multipart()
            message = self._codec_in.decode(frame)
            self.received.append(message)
            self.gateway_identity = identity
            match message:
                case m.InfoQuery(query_id=query_id) if self.answer_info:
                    await self.send(m.InfoReply(query_id, "SmolLM2-135M-Instruct", 2048, 2, 1, list(self.processes)))
                case m.SubmitRequest():
                    task = asyncio.create_task(self._reply(message))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                case m.AbortRequest(request_id=request_id, reason=reason):
                    self.aborts[request_id] = reason

    async def send(self, message: m.SchedulerToGateway) -> None:
        await self.socket.send_multipart([self.gateway_identity, self._codec_out.encode(message)])

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.socket.send_multipart([self.gateway_identity, *frames])

    async def _reply(self, submit: m.SubmitRequest) -> None:
        for message in self.script(submit):
            if submit.request_id in self.aborts:
                return
            await self.send(message)
            await asyncio.sleep(self.delay_s)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.context.destroy(linger=0)


@dataclass
class Harness:
    stub: pb_grpc.SpecServeStub
    health_stub: health_pb2_grpc.HealthStub
    client: SchedulerClient
    reporter: HealthReporter
    scheduler: FakeScheduler
    port: int


@asynccontextmanager
async def gateway(
    tokenizer: Tokenizer, script: Script, *, delay_s: float = 0.0, address: str | None = None
) -> AsyncIterator[Harness]:
    scheduler = FakeScheduler(script, delay_s=delay_s)
    client = SchedulerClient(address or scheduler.address, "gw-test", reply_timeout_s=0.5)
    await client.connect()
    server = grpc.aio.server()
    reporter = HealthReporter(health.aio.HealthServicer(), client, poll_interval_s=0.1)
    add_services(server, SpecServeServicer(Generation(tokenizer, client, GatewayMetrics())), reporter.servicer)
    port = server.add_insecure_port("127.0.0.1:0")
    await reporter.start()
    await server.start()
    tasks = [asyncio.create_task(client.run()), asyncio.create_task(scheduler.run())]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Harness(
            pb_grpc.SpecServeStub(channel), health_pb2_grpc.HealthStub(channel), client, reporter, scheduler, port
        )
    finally:
        await channel.close()
        await server.stop(None)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        client.close()
        scheduler.close()


async def collect(call: Any) -> list[pb.GenerateResponse]:
    return [response async for response in call]


async def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def text_script(tokenizer: Tokenizer, text: str, finish: m.FinishReason = "stop") -> Script:
    ids = tokenizer.encode(text) + list(tokenizer.eos_token_ids)
    return lambda submit: deltas(submit.request_id, ids, finish, len(submit.prompt_token_ids))


def endless_script(tokenizer: Tokenizer) -> Script:
    ids = tokenizer.encode("".join(f" {n}" for n in range(1, 400)))
    return lambda submit: deltas(submit.request_id, ids, "length", len(submit.prompt_token_ids))


# ---------------------------------------------------------------- Generate


def test_usage_carries_the_schedulers_speculation_counts_even_when_a_stop_string_ends_the_output(
    run: Any,
    tokenizer: Tokenizer,
) -> None:
    def script(submit: m.SubmitRequest) -> list[m.TokenDelta]:
        ids = tokenizer.encode("one two three four")
        return [
            m.TokenDelta(
                submit.request_id,
                ids[:2],
                None,
                3,
                2,
                num_draft_tokens=4,
                num_accepted_draft_tokens=1,
                num_verify_steps=1,
            ),
            m.TokenDelta(submit.request_id, ids[2:], "length", 3, len(ids), 8, 3, 2, num_cached_tokens=2),
        ]

    async def scenario() -> None:
        async with gateway(tokenizer, script) as h:
            whole = (await collect(h.stub.Generate(pb.GenerateRequest(prompt="x"))))[-1].usage
            cut = (
                await collect(h.stub.Generate(pb.GenerateRequest(prompt="x", params=pb.SamplingParams(stop=[" two"]))))
            )[-1].usage
        assert (whole.draft_tokens, whole.accepted_draft_tokens, whole.verify_steps, whole.cached_tokens) == (
            8,
            3,
            2,
            2,
        )
        assert (cut.draft_tokens, cut.accepted_draft_tokens, cut.verify_steps) == (4, 1, 1)

    run(scenario())


def test_generate_streams_text_ids_and_usage(run: Any, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with gateway(tokenizer, text_script(tokenizer, "Hello 😀 世界")) as h:
            responses = await collect(h.stub.Generate(pb.GenerateRequest(prompt="Say hi")))
            submit = h.scheduler.submits()[0]
            hello = h.scheduler.hellos()[0]
            assert hello == m.GatewayHello("gw-test", m.PROTOCOL_VERSION, hello.incarnation) and hello.incarnation
        assert submit.prompt_token_ids == tokenizer.encode("Say hi")
        assert (submit.max_tokens, submit.seed_given, submit.sampling.seed, submit.stop_token_ids) == (
            None,
            False,
            0,
            [2],
        )
        assert "".join(r.text for r in responses) == "Hello 😀 世界"
        assert all("\ufffd" not in r.text for r in responses)
        assert [i for r in responses for i in r.token_ids] == tokenizer.encode("Hello 😀 世界") + [2]
        assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not r.HasField("usage") for r in responses[:-1])
        last = responses[-1]
        assert last.finish_reason == pb.FINISH_REASON_STOP
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
            len(submit.prompt_token_ids),
            len(tokenizer.encode("Hello 😀 世界")) + 1,
        )
        assert len({r.request_id for r in responses}) == 1 and len(responses[0].request_id) == 32
        assert submit.request_id != responses[0].request_id  # the scheduler knows it by the gateway's own id

    run(scenario())


def test_chat_and_client_request_id(run: Any, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with gateway(tokenizer, text_script(tokenizer, "Hi!", finish="length")) as h:
            chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hello")])
            request = pb.GenerateRequest(
                chat=chat, request_id="client-7", params=pb.SamplingParams(seed=5, max_tokens=9, ignore_eos=True)
            )
            responses = await collect(h.stub.Generate(request))
            submit = h.scheduler.submits()[0]
        assert submit.request_id != "client-7" and responses[-1].request_id == "client-7"
        assert submit.prompt_token_ids == tokenizer.encode_chat([ChatMessage("user", "Hello")])
        assert (submit.seed_given, submit.sampling.seed, submit.max_tokens, submit.stop_token_ids) == (True, 5, 9, [])
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH

    run(scenario())


def test_stop_string_finishes_with_stop_and_aborts_the_scheduler(run: Any, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with gateway(tokenizer, endless_script(tokenizer), delay_s=0.005) as h:
            request = pb.GenerateRequest(prompt="Count", params=pb.SamplingParams(stop=["7 8", "never"]))
            responses = await collect(h.stub.Generate(request))
            request_id = h.scheduler.submits()[0].request_id
            await eventually(lambda: request_id in h.scheduler.aborts)
            assert h.scheduler.aborts[request_id] == "stop_string"
        assert "".join(r.text for r in responses) == " 1 2 3 4 5 6 "
        assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
        assert responses[-1].usage.completion_tokens == sum(len(r.token_ids) for r in responses)

    run(scenario())


def test_client_cancellation_aborts_the_request(run: Any, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with gateway(tokenizer, endless_script(tokenizer), delay_s=0.01) as h:
            call = h.stub.Generate(pb.GenerateRequest(prompt="Sing", request_id="to-cancel"))
            await call.read()
            await call.read()
            call.cancel()
            await eventually(lambda: bool(h.scheduler.aborts))
            assert h.scheduler.aborts == {h.scheduler.submits()[0].request_id: "client_cancelled"}

    run(scenario())


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("INVALID_ARGUMENT", grpc.StatusCode.INVALID_ARGUMENT),
        ("RESOURCE_EXHAUSTED", grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("UNAVAILABLE", grpc.StatusCode.UNAVAILABLE),
        ("INTERNAL", grpc.StatusCode.INTERNAL),
    ],
)
def test_scheduler_errors_map_to_grpc_status(
    run: Any, tokenizer: Tokenizer, code: m.ErrorCode, status: grpc.StatusCode
) -> None:
    ids = tokenizer.encode("partial")

    def script(submit: m.SubmitRequest) -> list[m.SchedulerToGateway]:
        return [
            *deltas(submit.request_id, ids, None, 2),
            m.RequestError(submit.request_id, code, f"scheduler says {code}"),
        ]

    async def scenario() -> None:
        async with gateway(tokenizer, script) as h:
            call = h.stub.Generate(pb.GenerateRequest(prompt="x"))
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for response in call:
                    received.append(response)
            assert not h.scheduler.aborts  # the scheduler ended it itself
        assert caught.value.code() == status and caught.value.details() == f"scheduler says {code}"
        assert "".join(r.text for r in received) == "partial"

    run(scenario())


def test_invalid_request_is_refused_before_the_scheduler_sees_it(run: Any, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with gateway(tokenizer, text_script(tokenizer, "x")) as h:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(h.stub.Generate(pb.GenerateRequest(prompt="x", params=pb.SamplingParams(top_p=2.0))))
            assert not h.scheduler.submits()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "params.top_p" in (caught.value.details() or "")

    run(scenario())


def test_a_request_id_chosen_by_two_clients_names_two_requests(run: Any, tokenizer: Tokenizer) -> None:
    """A client's request_id is its replies' name, never the scheduler's: a second client using the first one's id
    while it streams gets its own request, and neither can reach the other's (abort it, take its tokens)."""

    async def scenario() -> None:
        async with gateway(tokenizer, text_script(tokenizer, "Hello world"), delay_s=0.01) as h:
            first = h.stub.Generate(pb.GenerateRequest(prompt="x", request_id="same"))
            await first.read()
            second = await collect(h.stub.Generate(pb.GenerateRequest(prompt="y", request_id="same")))
            rest = await read_all(first)
            submits = h.scheduler.submits()
        assert len({s.request_id for s in submits}) == 2 and "same" not in {s.request_id for s in submits}
        assert "".join(r.text for r in second) == "Hello world" and {r.request_id for r in second} == {"same"}
        assert rest[-1].finish_reason == pb.FINISH_REASON_STOP
        assert not h.scheduler.aborts  # ending the second aborted nothing of the first's

    run(scenario())


def test_unreachable_scheduler_gives_unavailable_naming_the_address(run: Any, tokenizer: Tokenizer) -> None:
    with zmq.Context() as context, context.socket(zmq.ROUTER) as placeholder:
        free_port = placeholder.bind_to_random_port("tcp://127.0.0.1")
    silent = f"tcp://127.0.0.1:{free_port}"

    async def scenario() -> None:
        async with gateway(tokenizer, text_script(tokenizer, "x"), address=silent) as h:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(h.stub.Generate(pb.GenerateRequest(prompt="x")))
            assert await h.reporter.poll_once() == health_pb2.HealthCheckResponse.NOT_SERVING
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert silent in (caught.value.details() or "") and "--scheduler-timeout-s" in (caught.value.details() or "")

    run(scenario())


# ---------------------------------------------------------------- GetServerInfo, health, protocol errors


def test_get_server_info_mirrors_the_info_reply(run: Any, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with gateway(tokenizer, text_script(tokenizer, "x")) as h:
            info = await h.stub.GetServerInfo(pb.ServerInfoRequest())
        assert (info.model_name, info.max_model_len, info.num_waiting, info.num_running) == (
            "SmolLM2-135M-Instruct",
            2048,
            2,
            1,
        )
        process = info.processes[0]
        expected = ready_target()
        mirrored = [field for field in expected.__struct_fields__ if field != "protocol_errors"]  # in /metrics only
        assert set(mirrored) == set(pb.Process.DESCRIPTOR.fields_by_name)
        assert [getattr(process, field) for field in mirrored] == [getattr(expected, field) for field in mirrored]

    run(scenario())


def test_health_follows_ready_targets_and_scheduler_silence(run: Any, tokenizer: Tokenizer) -> None:
    async def status(h: Harness, service: str) -> int:
        return int((await h.health_stub.Check(health_pb2.HealthCheckRequest(service=service))).status)

    async def scenario() -> None:
        async with gateway(tokenizer, text_script(tokenizer, "x")) as h:
            NOT_SERVING, SERVING = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING
            assert await status(h, "") == NOT_SERVING  # before the first answer
            assert await h.reporter.poll_once() == SERVING
            assert [await status(h, "") for _ in range(1)] + [await status(h, "specserve.v1.SpecServe")] == [
                SERVING,
                SERVING,
            ]
            h.scheduler.processes = [
                ready_target("WARMING"),
                m.ProcessInfo("draft-0", "draft", State.READY, 1, 0.1, 0, 8, 16, 0, ""),
            ]
            assert await h.reporter.poll_once() == NOT_SERVING
            h.scheduler.processes = [ready_target()]
            assert await h.reporter.poll_once() == SERVING
            h.scheduler.answer_info = False
            assert await h.reporter.poll_once() == NOT_SERVING
            await h.reporter.enter_shutdown()
            h.scheduler.answer_info = True
            await h.reporter.poll_once()
            assert await status(h, "") == NOT_SERVING and await status(h, "specserve.v1.SpecServe") == NOT_SERVING

    run(scenario())


def test_malformed_frames_and_unknown_requests_are_counted_and_dropped(run: Any, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with gateway(tokenizer, text_script(tokenizer, "still fine")) as h:
            await h.stub.GetServerInfo(pb.ServerInfoRequest())  # the fake now knows the gateway's identity
            await h.scheduler.send_raw([b"\xc1 not msgpack"])
            await h.scheduler.send_raw([b"a", b"b"])
            await h.scheduler.send(m.TokenDelta("nobody", [1], None, 1, 1))
            await eventually(lambda: h.client.protocol_errors.total == 2 and h.client.num_dropped_messages == 1)
            assert dict(h.client.protocol_errors.counts) == {"decode": 1, "frames": 1}
            responses = await collect(h.stub.Generate(pb.GenerateRequest(prompt="x")))
        assert "".join(r.text for r in responses) == "still fine"

    run(scenario())


def test_hello_is_sent_again_when_the_scheduler_comes_back(run: Any, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with gateway(tokenizer, text_script(tokenizer, "x")) as h:
            await eventually(lambda: len(h.scheduler.hellos()) == 1)
            port = h.scheduler.port
            h.scheduler.socket.close(linger=0)
            await asyncio.sleep(0.2)
            h.scheduler.socket = h.scheduler.context.socket(zmq.ROUTER)  # a restarted scheduler on the same port
            h.scheduler.socket.bind(f"tcp://127.0.0.1:{port}")
            h.scheduler.received.clear()
            restarted = asyncio.create_task(h.scheduler.run())
            try:
                await eventually(lambda: len(h.scheduler.hellos()) == 1, timeout_s=10.0)
            finally:
                restarted.cancel()

    run(scenario())


def test_a_request_in_flight_goes_on_from_its_tokens_when_the_scheduler_comes_back(
    run: Any, tokenizer: Tokenizer
) -> None:
    counted = tokenizer.encode("".join(f" {n}" for n in range(1, 31))) + list(tokenizer.eos_token_ids)
    prompt_len = len(tokenizer.encode("count"))

    def continue_counting(submit: m.SubmitRequest) -> list[m.TokenDelta]:  # a pure function of the prompt, as greedy is
        rest = counted[len(submit.prompt_token_ids) - prompt_len :]
        return deltas(submit.request_id, rest, "stop", len(submit.prompt_token_ids))

    async def scenario() -> None:
        async with gateway(tokenizer, continue_counting, delay_s=0.02) as h:
            call = h.stub.Generate(
                pb.GenerateRequest(prompt="count", request_id="r1", params=pb.SamplingParams(max_tokens=100))
            )
            before = [await call.read() for _ in range(5)]
            await eventually(lambda: len(h.scheduler.submits()) == 1)
            (resumed_from,) = h.scheduler.submits()
            port = h.scheduler.port
            for task in list(h.scheduler._tasks):
                task.cancel()
            h.scheduler.socket.close(linger=0)  # the scheduler dies ...
            await asyncio.sleep(0.3)
            h.scheduler.socket = h.scheduler.context.socket(zmq.ROUTER)  # ... and a restarted one binds the port
            h.scheduler.socket.setsockopt(zmq.LINGER, 0)
            h.scheduler.socket.bind(f"tcp://127.0.0.1:{port}")
            h.scheduler.received.clear()
            h.scheduler.aborts.clear()
            restarted = asyncio.create_task(h.scheduler.run())
            try:
                after = await read_all(call)
                (resumed,) = h.scheduler.submits()
                received = [t for r in before for t in r.token_ids]
                first_id = resumed_from.request_id
                assert resumed.request_id not in ("r1", first_id) and resumed.max_tokens == 100 - len(received)
                assert resumed.prompt_token_ids == tokenizer.encode("count") + received
                assert resumed.resumed_tokens == len(received)  # penalties count them as the completion's
                assert h.scheduler.aborts == {first_id: "scheduler_reconnected"}  # in case the old one still ran it
                responses = [*before, *after]
                assert "".join(r.text for r in responses) == "".join(f" {n}" for n in range(1, 31))  # each token once
                assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
                assert responses[-1].usage.prompt_tokens == prompt_len
                assert responses[-1].usage.completion_tokens == len(counted)
            finally:
                restarted.cancel()

    run(scenario())


def test_a_resumed_request_passes_on_each_prompt_logprob_once(run: Any) -> None:
    from gateway.request_stream import RequestStream

    def scored(*positions: int) -> list[m.TokenLogprob]:
        return [m.TokenLogprob(-p / 10, []) for p in positions]

    class Sent:
        ids = iter(range(1, 100))

        async def send(self, message: object) -> None:
            pass

        def new_scheduler_id(self) -> str:
            return f"s{next(self.ids)}"

    async def scenario() -> None:
        stream = RequestStream(Sent(), "r", "s0")  # type: ignore[arg-type]
        await stream.submit(m.SubmitRequest("r", [1, 2, 3, 4, 5, 6], 2, m.SamplingParams(), [], prompt_logprobs=0))
        stream.deliver(m.TokenDelta("r", [], None, 6, 0, prompt_logprobs=scored(1, 2, 3)))
        abort, resumed = stream.resumption()  # type: ignore[misc]
        assert resumed.prompt_logprobs == 0 and resumed.resumed_tokens == 0  # no token yet: scored again
        stream.deliver(m.TokenDelta(resumed.request_id, [], None, 6, 0, prompt_logprobs=scored(1, 2)))
        stream.deliver(m.TokenDelta(resumed.request_id, [9], None, 6, 1, prompt_logprobs=scored(3, 4, 5)))
        _, again = stream.resumption()  # type: ignore[misc]
        assert again.prompt_logprobs is None and again.resumed_tokens == 1 and again.prompt_token_ids[-1] == 9
        passed = [await stream.next() for _ in range(3)]
        got = [entry.logprob for delta in passed for entry in delta.prompt_logprobs or []]  # type: ignore[union-attr]
        assert got == [-0.1, -0.2, -0.3, -0.4, -0.5]

    run(scenario())


def test_a_request_that_cannot_be_resumed_fails_unavailable_instead_of_waiting(run: Any) -> None:
    from gateway.errors import SchedulerUnavailable

    async def scenario() -> None:
        client = SchedulerClient("tcp://127.0.0.1:1", "gw-test", reply_timeout_s=0.1)
        sent: list[m.GatewayToScheduler] = []

        async def send(message: m.GatewayToScheduler) -> None:
            sent.append(message)

        client.send = send  # type: ignore[method-assign]
        async with client.open_request("r1") as stream:
            await stream.submit(m.SubmitRequest("r1", [1, 2, 3], 8, m.SamplingParams(), []))
            stream.deliver(m.TokenDelta("r1", [7], None, 3, 1))

            async def unavailable(message: m.GatewayToScheduler) -> None:
                raise SchedulerUnavailable("the scheduler's socket stayed full")

            client.send = unavailable  # type: ignore[method-assign]
            await client._resume_streams()  # the connection came back, but nothing can be sent
            assert (await stream.next()).token_ids == [7]  # type: ignore[union-attr]
            failure = await stream.next()
            assert isinstance(failure, m.RequestError) and failure.request_id == "r1" and failure.code == "UNAVAILABLE"
            client.send = send  # type: ignore[method-assign]

    run(scenario())


# ---------------------------------------------------------------- the process: python -m gateway


def gateway_command(model_dir: Path, scheduler_address: str, *options: str) -> list[str]:
    return [
        sys.executable, "-m", "gateway", "--model", str(model_dir), "--scheduler-address", scheduler_address,
        "--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--log-json", "--insecure-loopback", *options,
    ]  # fmt: skip


def test_gateway_process_starts_without_scheduler_reports_not_serving_and_stops_on_sigterm(
    default_model_dir: Path,
) -> None:
    with zmq.Context() as context, context.socket(zmq.ROUTER) as placeholder:
        free_port = placeholder.bind_to_random_port("tcp://127.0.0.1")
    command = gateway_command(default_model_dir, f"tcp://127.0.0.1:{free_port}", "--scheduler-timeout-s", "0.3")
    process = subprocess.Popen(command, cwd=REPO_ROOT, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = listening_port(process)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as caught:
                pb_grpc.SpecServeStub(channel).GetServerInfo(pb.ServerInfoRequest(), timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "specserve.v1.SpecServe" in reflected_services(channel)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
        assert process.stderr is not None and process.stdout is not None
        events = [json.loads(line)["event"] for line in process.stderr.read().splitlines() if line.startswith("{")]
        assert "gateway.draining" in events and events[-1] == "gateway.stopped"
        assert process.stdout.read() == ""  # logs go to stderr only
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def reflected_services(channel: grpc.Channel) -> list[str]:
    """What `grpcurl list` shows, through the reflection service."""
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    return list(ProtoReflectionDescriptorDatabase(channel).get_services())


def listening_port(process: subprocess.Popen[str]) -> int:
    assert process.stderr is not None
    for line in process.stderr:
        if line.startswith("{") and json.loads(line)["event"] == "gateway.listening":
            return int(json.loads(line)["port"])
    raise AssertionError(f"the gateway exited without listening (status {process.wait()})")


@asynccontextmanager
async def gateway_process(
    tokenizer: Tokenizer, model_dir: Path
) -> AsyncIterator[tuple[asyncio.subprocess.Process, FakeScheduler, int, int]]:
    """`python -m gateway` (grace 20 s) before a fake scheduler that streams " ok" 100 times, about 1 s: the process,
    the scheduler, and the gRPC and HTTP ports."""
    scheduler = FakeScheduler(text_script(tokenizer, " ok" * 100), delay_s=0.01)
    scheduler_task = asyncio.create_task(scheduler.run())
    command = gateway_command(model_dir, scheduler.address, "--shutdown-grace-s", "20")
    process = await asyncio.create_subprocess_exec(*command, cwd=REPO_ROOT, stderr=subprocess.PIPE)
    assert process.stderr is not None
    try:
        port, http_port = await async_listening_ports(process.stderr)
        yield process, scheduler, port, http_port
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        scheduler_task.cancel()
        scheduler.close()


@pytest.mark.parametrize("num_signals", [1, 2])
def test_sigterm_drains_streams_in_flight_and_a_second_one_stops_at_once(
    run: Any, tokenizer: Tokenizer, default_model_dir: Path, num_signals: int
) -> None:
    async def scenario() -> None:
        async with gateway_process(tokenizer, default_model_dir) as (process, scheduler, port, _):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.SpecServeStub(channel)
                call = stub.Generate(pb.GenerateRequest(prompt="x", request_id="in-flight"))
                first = await call.read()
                process.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.GetServerInfo(pb.ServerInfoRequest(), timeout=5)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # no new RPCs while draining
                if num_signals == 2:
                    process.send_signal(signal.SIGTERM)
                    with pytest.raises(grpc.aio.AioRpcError):
                        await read_all(call)
                    await eventually(lambda: list(scheduler.aborts.values()) == ["client_cancelled"])
                else:
                    responses = [first, *await read_all(call)]
                    assert "".join(r.text for r in responses) == " ok" * 100
                    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
            assert await asyncio.wait_for(process.wait(), timeout=15) == 0

    run(scenario())


def test_sigterm_lets_http_requests_in_flight_finish_too(
    run: Any, tokenizer: Tokenizer, default_model_dir: Path
) -> None:
    import aiohttp

    async def scenario() -> None:
        async with gateway_process(tokenizer, default_model_dir) as (process, _, _, http_port):
            body = {"prompt": "x", "max_tokens": 200, "stream": True}
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body) as response,
            ):
                assert response.status == 200
                events = [await response.content.readline()]
                process.send_signal(signal.SIGTERM)
                async for line in response.content:
                    events.append(line)
            payloads = [line[len(b"data: ") :].strip() for line in events if line.startswith(b"data: ")]
            assert payloads[-1] == b"[DONE]"
            chunks = [json.loads(p) for p in payloads[:-1]]
            assert "".join(c["choices"][0]["text"] for c in chunks) == " ok" * 100
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
            assert await asyncio.wait_for(process.wait(), timeout=15) == 0

    run(scenario())


async def async_listening_ports(stderr: asyncio.StreamReader) -> tuple[int, int]:
    """The gRPC and HTTP ports a gateway process listens on, from its log."""
    while line := (await stderr.readline()).decode():
        if line.startswith("{") and json.loads(line)["event"] == "gateway.listening":
            event = json.loads(line)
            return int(event["port"]), int(event["http_port"])
    raise AssertionError("the gateway exited without listening")


async def read_all(call: Any) -> list[pb.GenerateResponse]:
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


# ---------------------------------------------------------------- the client: specserve generate


def generate_args(address: str, *options: str) -> Any:
    import argparse

    from specserve.client import add_generate_arguments

    parser = argparse.ArgumentParser()
    add_generate_arguments(parser)
    return parser.parse_args(["--address", address, *options])


def test_cli_generate_prints_json_streams_text_and_reports_errors(
    run: Any, tokenizer: Tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    from specserve.client import run_generate

    async def scenario() -> None:
        async with gateway(tokenizer, text_script(tokenizer, "Paris 🇫🇷")) as h:
            address = f"127.0.0.1:{h.port}"
            json_args = generate_args(
                address, "--chat", "Capital?", "--json", "--max-tokens", "5", "--seed", "3", "--stop", "a", "b"
            )
            assert await asyncio.to_thread(run_generate, json_args) == 0
            submit = h.scheduler.submits()[0]
            assert (submit.max_tokens, submit.sampling.seed, submit.seed_given) == (5, 3, True)
            printed = json.loads(capsys.readouterr().out)
            assert printed["text"] == "P" and printed["finish_reason"] == "stop"  # stop string "a" cuts "Paris"
            assert printed["usage"] == {
                "prompt_tokens": len(submit.prompt_token_ids),
                "completion_tokens": len(printed["token_ids"]),
                "draft_tokens": 0,
                "accepted_draft_tokens": 0,
                "verify_steps": 0,
                "cached_tokens": 0,
            }
            assert await asyncio.to_thread(run_generate, generate_args(address, "--prompt", "Capital?")) == 0
            assert capsys.readouterr().out == "Paris 🇫🇷"
            assert await asyncio.to_thread(run_generate, generate_args(address, "--prompt", "x", "--top-p", "0")) == 1
            assert capsys.readouterr().err == "error: INVALID_ARGUMENT: params.top_p: must be in (0, 1], got 0.0\n"

    run(scenario())


def test_a_request_in_flight_waits_for_a_silent_scheduler_up_to_the_restart_window(run: Any) -> None:
    """A supervisor restarting the scheduler takes seconds: the streams in flight ask again until the window has passed,
    and go on as soon as it answers; after the window they fail UNAVAILABLE, naming the setting."""
    from gateway.errors import SchedulerUnavailable

    async def scenario() -> None:
        client = SchedulerClient("tcp://127.0.0.1:1", "gw-test", reply_timeout_s=0.05, restart_window_s=1.0)
        asked: list[float] = []
        answers_after = 3

        async def query_info() -> m.InfoReply:
            asked.append(time.monotonic())
            if len(asked) <= answers_after:
                raise SchedulerUnavailable("the scheduler at tcp://127.0.0.1:1 did not answer within 0.05 s")
            return m.InfoReply(1, "model", 2048, 0, 0, [])

        client.query_info = query_info  # type: ignore[method-assign]
        await client.wait_reachable()  # back after 3 silent tries
        assert len(asked) == answers_after + 1
        answers_after = 10**6  # gone for good
        started = time.monotonic()
        with pytest.raises(SchedulerUnavailable, match="--scheduler-restart-window-s"):
            await client.wait_reachable()
        assert 1.0 <= time.monotonic() - started < 3.0

    run(scenario())
