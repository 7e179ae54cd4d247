"""Each socket's bound (proto/frames.py) holds the largest message that may legally come on it.

Every message here is built at the limits: every list at its longest, every int at 2^64 - 1
(msgpack's widest), every float a double, every string of 4-byte characters. Each must fit
its socket's bound, and the bound must not be much larger than the worst case.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from gateway.errors import InvalidArgument
from gateway.scheduler_client import SchedulerClient
from proto import frames
from proto import messages as m
from proto.lifecycle import State
from scheduler.outbox import Outbox
from scheduler.requests import Request
from tests.unit.scheduler_fakes import Sim

BIG = 2**64 - 1  # an int at msgpack's widest
WIDE = "\U0001f600"  # a character of 4 bytes in UTF-8
LONGEST_STATE = max((state for state in State), key=lambda state: len(state.value))

# The scheduler's defaults, and a small stack's settings with the widest features.
SCHEDULER_LIMITS = [
    frames.FrameLimits(
        max_model_len=2048,
        max_num_seqs=256,
        max_num_batched_tokens=512,
        max_draft_tokens=6,
        max_propose_seqs=16,
        feature_width=576,
    ),
    frames.FrameLimits(
        max_model_len=64,
        max_num_seqs=3,
        max_num_batched_tokens=40,
        max_draft_tokens=m.MAX_DRAFT_TOKENS,
        max_propose_seqs=3,
        feature_width=m.MAX_FEATURE_WIDTH,
    ),
]


def text(num_chars: int) -> str:
    return WIDE * num_chars


def fits(message: msgspec.Struct, bound: int) -> int:
    """The encoded size of `message`, checked against `bound`."""
    size = len(msgspec.msgpack.encode(message))
    assert size <= bound, (type(message).__name__, size, bound)
    return size


def assert_tight(largest: int, bound: int) -> None:
    """The bound is the worst case with its safety margin, not far above it."""
    assert bound <= max(frames.FLOOR_BYTES, 2 * frames.SAFETY * largest), (largest, bound)


def logprob() -> m.TokenLogprob:
    return m.TokenLogprob(-1e300, [m.TopLogprob(BIG, -1e300) for _ in range(m.MAX_TOP_LOGPROBS)])


def sampling() -> m.SamplingParams:
    penalties = m.Penalties(
        presence=-2.0,
        frequency=-2.0,
        repetition=100.0,
        logit_bias={BIG - i: -100.0 for i in range(m.MAX_LOGIT_BIAS_ENTRIES)},
        min_tokens=BIG,
        stop_token_ids=[BIG] * m.MAX_STOP_TOKEN_IDS,
    )
    return m.SamplingParams(temperature=1e4, top_p=1e-300, top_k=BIG, seed=BIG, penalties=penalties)


def sparse_dist() -> m.SparseDist:
    return m.SparseDist([BIG] * m.MAX_SPARSE_DIST_TOKENS, [1e-300] * m.MAX_SPARSE_DIST_TOKENS)


def error_counts() -> dict[str, int]:
    return {text(m.MAX_ERROR_KIND_CHARS - 2) + f"{i:02}": BIG for i in range(m.MAX_ERROR_KINDS)}


def shares(total: int, parts: int) -> list[int]:
    """`total` in `parts` parts as even as can be."""
    return [total // parts + (i < total % parts) for i in range(parts)]


@pytest.mark.parametrize("max_model_len", [1, 64, 2048, 32768])
def test_the_largest_messages_from_a_gateway_fit_the_schedulers_gateway_socket(max_model_len: int) -> None:
    bound = frames.gateway_to_scheduler(max_model_len)
    submit = m.SubmitRequest(
        request_id=text(m.MAX_REQUEST_ID_CHARS),
        prompt_token_ids=[BIG] * max_model_len,
        max_tokens=BIG,
        sampling=sampling(),
        stop_token_ids=[BIG] * m.MAX_STOP_TOKEN_IDS,
        seed_given=False,
        logprobs=BIG,
        prompt_logprobs=BIG,
        resumed_tokens=BIG,
        grammar=text(m.MAX_GRAMMAR_CHARS),
        cache_salt=text(m.MAX_CACHE_SALT_CHARS),
        tenant=text(m.MAX_TENANT_CHARS),
    )
    largest = fits(submit, bound)
    fits(m.AbortRequest(text(m.MAX_REQUEST_ID_CHARS), text(m.MAX_REASON_CHARS)), bound)
    fits(m.GatewayHello(text(m.MAX_NAME_CHARS), BIG, text(m.MAX_NAME_CHARS)), bound)
    fits(m.GatewayHeartbeat(text(m.MAX_NAME_CHARS), BIG, text(m.MAX_NAME_CHARS)), bound)
    fits(m.InfoQuery(BIG, True), bound)
    assert_tight(largest, bound)
    # A prompt longer than the context, with the rest at its largest, does not fit: the gateway refuses it.
    longer = msgspec.structs.replace(submit, prompt_token_ids=[BIG] * (2 * max_model_len + (1 << 20)))
    assert len(msgspec.msgpack.encode(longer)) > bound


def test_the_largest_messages_to_a_gateway_fit_its_socket() -> None:
    bound = frames.scheduler_to_gateway()
    num_tokens = m.MAX_DRAFT_TOKENS + 1
    delta = m.TokenDelta(
        text(m.MAX_REQUEST_ID_CHARS),
        [BIG] * num_tokens,
        "length",
        BIG,
        BIG,
        BIG,
        BIG,
        BIG,
        BIG,
        logprobs=[logprob()] * num_tokens,
        prompt_logprobs=[logprob()] * m.MAX_PROMPT_LOGPROBS_PER_DELTA,
    )
    process = m.ProcessInfo(
        process_id=text(m.MAX_NAME_CHARS),
        role="target",
        state=LONGEST_STATE,
        incarnation=BIG,
        heartbeat_age_s=1e300,
        num_used_kv_pages=BIG,
        num_kv_pages=BIG,
        kv_page_size=BIG,
        num_running=BIG,
        failure=text(m.MAX_REASON_CHARS),
        protocol_errors=error_counts(),
        num_cached_kv_pages=BIG,
        prefix_cache_queried_tokens=BIG,
        prefix_cache_hit_tokens=BIG,
        num_preemptions=BIG,
        kernels=text(m.MAX_KERNELS_CHARS),
        batch_invariant=True,
        step_ms_per_row_by_range=[1e300] * 3,
    )
    by_position = {k: BIG for k in range(num_tokens)}
    sources = {name: m.SourceAcceptance(BIG, BIG, BIG, [1e300] * m.MAX_DRAFT_TOKENS) for name in m.PROPOSAL_SOURCES}
    speculation = m.SpeculationInfo(
        BIG,
        BIG,
        BIG,
        BIG,
        1e300,
        1e300,
        steps_by_k=by_position,
        proposed_by_position=by_position,
        accepted_by_position=by_position,
        sources=sources,
        policy=text(m.MAX_NAME_CHARS),
    )
    info = m.InfoReply(
        BIG,
        text(m.MAX_NAME_CHARS),
        BIG,
        BIG,
        BIG,
        [process] * m.MAX_LISTED_PROCESSES,
        speculation,
        protocol_errors=error_counts(),
        num_gateways=BIG,
        num_gone_gateways=BIG,
        num_orphaned_requests=BIG,
    )
    largest = max(fits(m.TokenDeltas([delta] * m.MAX_DELTAS_PER_FRAME), bound), fits(info, bound))
    fits(m.RequestError(text(m.MAX_REQUEST_ID_CHARS), "RESOURCE_EXHAUSTED", text(m.MAX_REASON_CHARS)), bound)
    assert_tight(largest, bound)


@pytest.mark.parametrize("limits", SCHEDULER_LIMITS, ids=["defaults", "widest-features"])
def test_the_largest_messages_from_a_worker_fit_the_schedulers_worker_socket(limits: frames.FrameLimits) -> None:
    bound = frames.worker_to_scheduler(limits)
    k, num_seqs = limits.max_draft_tokens, limits.max_num_seqs
    output = m.SeqOutput(
        text(m.MAX_REQUEST_ID_CHARS),
        [BIG] * (k + 1),
        [BIG] * k,
        [logprob()] * (k + 1),
        [BIG] * m.MAX_DRAFT_TOKENS,
        True,
    )
    # The step's tokens (decodes with what their grammars force, then prompt chunks) stand, each with its features.
    features = [
        m.SeqFeatures(
            text(m.MAX_REQUEST_ID_CHARS),
            m.FeatureRows(BIG, rows, BIG, "bfloat16", bytes(rows * limits.feature_width * 4)),
        )
        for rows in shares(limits.max_step_tokens, num_seqs)
    ]
    scored = [
        m.PromptLogprobs(text(m.MAX_REQUEST_ID_CHARS), BIG, [logprob()] * entries)
        for entries in shares(limits.max_num_batched_tokens, num_seqs)
    ]
    result = m.StepResult(text(m.MAX_NAME_CHARS), BIG, BIG, [output] * num_seqs, 1e300, features, scored)
    largest = fits(result, bound)
    proposal = m.Proposal(
        text(m.MAX_REQUEST_ID_CHARS),
        BIG,
        [BIG] * k,
        [sparse_dist()] * k,
        [BIG] * k,
        text(m.MAX_NAME_CHARS),
        [1e300] * k,
    )
    fits(m.ProposeResult(text(m.MAX_NAME_CHARS), BIG, BIG, [proposal] * limits.max_propose_seqs, 1e300), bound)
    name = text(m.MAX_NAME_CHARS)
    fits(
        m.WorkerHello(name, "target", BIG, BIG, BIG, name, name, BIG, BIG, BIG, BIG, name, name, name, BIG, BIG, name),
        bound,
    )
    fits(m.LifecycleReport(name, BIG, LONGEST_STATE, LONGEST_STATE, 1e300, BIG, text(m.MAX_KERNELS_CHARS)), bound)
    fits(m.WorkerFailed(name, BIG, LONGEST_STATE, name, text(m.MAX_REASON_CHARS)), bound)
    fits(m.Heartbeat(name, BIG, LONGEST_STATE, BIG, BIG, error_counts()), bound)
    fits(m.StepRefused(name, BIG, BIG, LONGEST_STATE, text(m.MAX_REASON_CHARS), text(m.MAX_REQUEST_ID_CHARS)), bound)
    fits(m.ProposeRefused(name, BIG, BIG, LONGEST_STATE, text(m.MAX_REASON_CHARS)), bound)
    assert_tight(largest, bound)


def test_the_largest_step_fits_a_target_workers_socket() -> None:
    # 8 sequences rather than 256: each carries a grammar of 4 MiB at most, and the count is the same for each.
    limits = frames.FrameLimits(
        max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=512, max_draft_tokens=8, kv_page_size=16
    )
    bound = frames.scheduler_to_target(limits)
    k = limits.max_draft_tokens
    seqs = [
        m.SeqWork(
            text(m.MAX_REQUEST_ID_CHARS),
            [BIG] * limits.max_block_table_pages,
            BIG,
            [BIG] * tokens,
            True,
            sampling(),
            BIG,
            [sparse_dist()] * k,
            [BIG] * k,
            BIG,
            BIG,
            BIG,
            [BIG] * limits.max_model_len,
            BIG,
            text(m.MAX_GRAMMAR_CHARS),
        )
        for tokens in shares(limits.max_step_tokens, limits.max_num_seqs)
    ]
    largest = fits(m.StepRequest(BIG, BIG, seqs, True), bound)
    fits(m.Drain(BIG), bound)
    assert_tight(largest, bound)


@pytest.mark.parametrize("feature_width", [0, 576])
def test_the_largest_propose_request_fits_the_draft_services_socket(feature_width: int) -> None:
    limits = frames.FrameLimits(
        max_model_len=512,
        max_num_seqs=16,
        max_num_batched_tokens=0,
        max_draft_tokens=8,
        max_propose_seqs=16,
        feature_width=feature_width,
    )
    bound = frames.scheduler_to_draft(limits)
    length = limits.max_model_len
    features = m.FeatureRows(BIG, length, BIG, "bfloat16", bytes(length * feature_width * 4))
    seq = m.ProposeSeq(
        text(m.MAX_REQUEST_ID_CHARS), BIG, BIG, [BIG] * length, BIG, sampling(), features, text(m.MAX_TENANT_CHARS)
    )
    largest = fits(m.ProposeRequest(BIG, BIG, [seq] * limits.max_propose_seqs), bound)
    fits(m.ReleaseSequences(BIG, [text(m.MAX_REQUEST_ID_CHARS)] * m.MAX_RELEASE_IDS), bound)
    fits(m.RecordText(BIG, text(m.MAX_TENANT_CHARS), [BIG] * length), bound)
    assert_tight(largest, bound)


def test_a_message_with_a_field_not_counted_is_an_error() -> None:
    class Unknown(msgspec.Struct, tag="unknown"):
        name: str
        count: int

    with pytest.raises(TypeError, match=r"Unknown.name is not a scalar"):
        frames._struct(Unknown)  # noqa: SLF001 - the counting rule itself
    assert frames._struct(Unknown, name=10) > 10  # noqa: SLF001


def test_what_the_scheduler_sends_a_gateway_keeps_to_the_per_frame_limits() -> None:
    outbox = Outbox()
    requests = [Request(f"r{i}", b"gw", [1, 2, 3], 10, m.SamplingParams(), frozenset(), 0.0) for i in range(150)]
    long_prompt = [logprob()] * (2 * m.MAX_PROMPT_LOGPROBS_PER_DELTA + 10)
    outbox.emit(requests[0], [], None, prompt_logprobs=long_prompt)
    for request in requests:
        outbox.emit(request, [5], None)
    outbox.to_gateway(b"gw", m.RequestError("r0", "INTERNAL", "x" * 100_000))
    outbox.to_worker(b"draft", m.ReleaseSequences(1, [f"r{i}" for i in range(2500)]))
    sent = outbox.take()
    frames_to_gateway = [item.message for item in sent if not item.to_worker]
    deltas = [d for frame in frames_to_gateway if isinstance(frame, m.TokenDeltas) for d in frame.deltas]
    assert all(len(f.deltas) <= m.MAX_DELTAS_PER_FRAME for f in frames_to_gateway if isinstance(f, m.TokenDeltas))
    assert len(deltas) == 3 + 150  # the prompt log-probabilities in 3 deltas, then every request's token
    assert [len(d.prompt_logprobs or []) for d in deltas[:3]] == [256, 256, 10]
    assert [d.request_id for d in deltas[3:]] == [r.request_id for r in requests]  # in order
    error = frames_to_gateway[-1]
    assert isinstance(error, m.RequestError) and len(error.message) == m.MAX_REASON_CHARS
    released = [item.message for item in sent if item.to_worker]
    assert [len(r.request_ids) for r in released if isinstance(r, m.ReleaseSequences)] == [1024, 1024, 452]
    for frame in frames_to_gateway:
        fits(frame, frames.scheduler_to_gateway())


def test_what_a_worker_says_of_itself_reaches_a_gateway_cut_to_its_limits() -> None:
    sim = Sim()
    worker = sim.worker("w0").start()
    worker.send(
        m.Heartbeat("w0", worker.incarnation, State.READY, 0, 0, {f"kind-{i}-" + "x" * 200: i for i in range(10_000)})
    )
    worker.fail("y" * 1_000_000)
    process = sim.process("w0")
    assert len(process.protocol_errors) == m.MAX_ERROR_KINDS
    assert all(len(kind) <= m.MAX_ERROR_KIND_CHARS for kind in process.protocol_errors)
    assert len(process.failure) == m.MAX_REASON_CHARS
    fits(sim.info(), frames.scheduler_to_gateway())


class _Scheduler:
    """A ROUTER that answers info queries with a context of `max_model_len` tokens and keeps what else comes."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.MAXMSGSIZE, frames.gateway_to_scheduler(max_model_len))
        self.address = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self.received: list[m.GatewayToScheduler] = []
        self._codec_in: m.Codec[m.GatewayToScheduler] = m.Codec(m.GatewayToScheduler)
        self._codec_out: m.Codec[m.SchedulerToGateway] = m.Codec(m.SchedulerToGateway)

    async def run(self) -> None:
        while True:
            identity, frame = await self.socket.recv_multipart()
            message = self._codec_in.decode(frame)
            self.received.append(message)
            if isinstance(message, m.InfoQuery):
                reply = m.InfoReply(message.query_id, "tiny", self.max_model_len, 0, 0, [])
                await self.socket.send_multipart([identity, self._codec_out.encode(reply)])


def test_a_gateway_refuses_a_request_larger_than_the_scheduler_takes_and_stays_connected() -> None:
    async def scenario() -> None:
        scheduler = _Scheduler(max_model_len=64)
        client = SchedulerClient(scheduler.address, "gw-frames", reply_timeout_s=5.0)
        await client.connect()
        tasks = [asyncio.create_task(scheduler.run()), asyncio.create_task(client.run())]
        try:
            huge = m.SubmitRequest("huge", [70_000] * 2_000_000, 4, m.SamplingParams(), [])  # 10 MB as msgpack
            with pytest.raises(
                InvalidArgument,
                match=r"prompt: .* more than the \d+ it takes: the prompt is longer "
                r"than the context of 64 tokens",
            ):
                await client.send(huge)
            await client.send(m.SubmitRequest("small", [1, 2, 3], 4, m.SamplingParams(), []))
            deadline = time.monotonic() + 5
            while not any(isinstance(x, m.SubmitRequest) for x in scheduler.received):
                assert time.monotonic() < deadline, scheduler.received
                await asyncio.sleep(0.05)
            assert [x.request_id for x in scheduler.received if isinstance(x, m.SubmitRequest)] == ["small"]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            client.close()
            scheduler.context.destroy(linger=0)

    asyncio.run(scenario())
