"""Wire messages: every type round-trips through Codec; anything malformed raises msgspec.DecodeError, nothing else."""

from __future__ import annotations

import typing

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto import messages as m
from proto.lifecycle import State

SAMPLING = m.SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=2**62 + 5)

GATEWAY_TO_SCHEDULER: list[msgspec.Struct] = [
    m.SubmitRequest("r-1", [1, 2, 3], 16, SAMPLING, [2], seed_given=False),
    m.SubmitRequest("r-2", [5], None, m.SamplingParams(), []),
    m.AbortRequest("r-1", "client_cancelled"),
    m.InfoQuery(query_id=7),
    m.GatewayHello("gateway-1", m.PROTOCOL_VERSION),
    m.GatewayHeartbeat("gateway-1", m.PROTOCOL_VERSION),
]
SCHEDULER_TO_GATEWAY: list[msgspec.Struct] = [
    m.TokenDelta("r-1", [11, 12], None, 3, 2),
    m.TokenDelta("r-1", [], "length", 3, 16),
    m.TokenDeltas([m.TokenDelta("r-1", [13], None, 3, 3), m.TokenDelta("r-3", [7], "stop", 5, 9)]),
    m.RequestError("r-2", "UNAVAILABLE", "no READY worker within 30.0 s (--no-worker-timeout-s)"),
    m.InfoReply(
        7,
        "SmolLM2-135M-Instruct",
        2048,
        1,
        2,
        [
            m.ProcessInfo(
                "w0",
                "target",
                State.READY,
                3,
                0.25,
                2,
                64,
                16,
                2,
                "",
                num_cached_kv_pages=1,
                prefix_cache_queried_tokens=40,
                prefix_cache_hit_tokens=32,
                num_preemptions=1,
                kernels="native (linear kernel: avx2)",
            ),
            m.ProcessInfo("w1", "target", "FAILED", 1, 9.5, 0, 64, 16, 0, "LOADING: OSError: no such file"),
        ],
        num_gateways=2,
        num_gone_gateways=1,
        num_orphaned_requests=8,
    ),
    m.Probe(),
]
SCHEDULER_TO_WORKER: list[msgspec.Struct] = [
    m.StepRequest(
        4,
        2,
        [
            m.SeqWork("r-1", [0], 0, [1, 2, 3], True, SAMPLING),
            m.SeqWork("r-2", [5, 6], 17, [9, 8, 7], True, m.SamplingParams(), num_draft_tokens=2),
            m.SeqWork("r-3", [1, 3], 0, [4] * 32, False, m.SamplingParams()),
            m.SeqWork(
                "r-4",
                [2, 7, 9],
                40,
                [5, 6, 7],
                True,
                SAMPLING,
                num_draft_tokens=2,
                draft_dists=[m.SparseDist([6, 9], [0.75, 0.25]), m.SparseDist([7], [1.0])],
            ),
        ],
    ),
    m.Drain(2),
    m.Probe(),
]
SCHEDULER_TO_DRAFT: list[msgspec.Struct] = [
    m.ProposeRequest(
        3,
        9,
        [
            m.ProposeSeq("r-1", 0, 0, [1, 2, 3, 4], 4, m.SamplingParams()),
            m.ProposeSeq("r-2", 12, 3, [8], 2, SAMPLING),
        ],
    ),
    m.ReleaseSequences(9, ["r-1", "r-2"]),
    m.RecordText(9, "key:0123456789abcdef", [1, 2, 3, 4]),
    m.Drain(9),
    m.Probe(),
]
WORKER_TO_SCHEDULER: list[msgspec.Struct] = [
    m.WorkerHello(
        "w0",
        "target",
        2,
        m.PROTOCOL_VERSION,
        4242,
        "SmolLM2-135M-Instruct",
        "fp-1",
        49152,
        2048,
        4096,
        16,
        "bfloat16",
        "cuda:0",
    ),
    m.LifecycleReport("w0", 2, State.LOADING, State.STARTING, 0.125),
    m.LifecycleReport(
        "w0",
        2,
        State.READY,
        State.WARMING,
        2.5,
        max_draft_tokens=0,
        kernels="torch (turned off by SPECSERVE_NATIVE_OPS=0)",
    ),
    m.LifecycleReport(
        "w0",
        2,
        State.READY,
        State.WARMING,
        2.5,
        kernels="native",
        batch_invariant=True,
        step_timings=[m.StepTiming(9, 0, 45, 12.5)],
    ),
    m.WorkerFailed("w0", 2, State.LOADING, "OSError", "model.safetensors: no such file"),
    m.Heartbeat("w0", 2, State.READY, 3, 118),
    m.StepResult("w0", 2, 4, [m.SeqOutput("r-1", [42]), m.SeqOutput("r-2", [9, 8, 13], accepted_nodes=[0, 1])], 12.5),
    m.StepRefused("w0", 2, 4, State.WARMING, "not READY"),
    m.ProposeResult(
        "d0",
        9,
        3,
        [
            m.Proposal("r-1", 4, [5, 6, 7, 8]),
            m.Proposal("r-2", 10, [9], [m.SparseDist([9, 3], [0.5, 0.5])]),
            m.Proposal("r-3", 0, []),
            m.Proposal("r-4", 3, [1, 2, 3], parents=[-1, -1, 0], source="phrases"),
        ],
        1.5,
    ),
    m.ProposeRefused("d0", 9, 3, State.LOADING, "not READY"),
]

DIRECTIONS = {
    "gateway_to_scheduler": (m.GatewayToScheduler, GATEWAY_TO_SCHEDULER),
    "scheduler_to_gateway": (m.SchedulerToGateway, SCHEDULER_TO_GATEWAY),
    "scheduler_to_worker": (m.SchedulerToWorker, SCHEDULER_TO_WORKER),
    "scheduler_to_draft": (m.SchedulerToDraft, SCHEDULER_TO_DRAFT),
    "worker_to_scheduler": (m.WorkerToScheduler, WORKER_TO_SCHEDULER),
}
ALL_CASES = [(name, message) for name, (_, messages) in DIRECTIONS.items() for message in messages]


def tag_of(message_type: type[msgspec.Struct]) -> object:
    return message_type.__struct_config__.tag


def codec(direction: str) -> m.Codec[typing.Any]:
    return m.Codec(DIRECTIONS[direction][0])


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_the_samples_cover_every_type_of_the_union(direction: str) -> None:
    union, samples = DIRECTIONS[direction]
    assert {type(s) for s in samples} == set(typing.get_args(union))


@pytest.mark.parametrize(
    ("direction", "message"), ALL_CASES, ids=[f"{d}-{type(msg).__name__}-{i}" for i, (d, msg) in enumerate(ALL_CASES)]
)
def test_every_message_round_trips(direction: str, message: msgspec.Struct) -> None:
    c = codec(direction)
    decoded = c.decode(c.encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


def test_tags_are_unique_across_all_messages() -> None:
    types = {t for union, _ in DIRECTIONS.values() for t in typing.get_args(union)}  # Drain goes to both roles
    tags = [tag_of(t) for t in types]
    assert len(tags) == len(set(tags))


def test_messages_are_frozen() -> None:
    with pytest.raises(AttributeError):
        m.AbortRequest("r-1", "x").request_id = "r-2"  # type: ignore[misc]


def test_a_message_of_the_other_direction_is_refused() -> None:
    step = codec("scheduler_to_worker").encode(SCHEDULER_TO_WORKER[0])
    with pytest.raises(msgspec.ValidationError):
        codec("worker_to_scheduler").decode(step)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("frame", [b"", b"\xc1", b"\xff\xfe\xfd", b"not msgpack at all", b"\x92\xc1\xc1"], ids=repr)
def test_garbage_bytes_raise_decode_error(direction: str, frame: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        codec(direction).decode(frame)


@pytest.mark.parametrize(
    ("direction", "message"), ALL_CASES, ids=[f"{d}-{type(msg).__name__}-{i}" for i, (d, msg) in enumerate(ALL_CASES)]
)
def test_truncated_msgpack_raises_decode_error(direction: str, message: msgspec.Struct) -> None:
    c = codec(direction)
    frame = c.encode(message)
    for cut in range(len(frame)):
        with pytest.raises(msgspec.DecodeError):
            c.decode(frame[:cut])


WRONG_SCHEMA = [
    (
        "gateway_to_scheduler",
        {
            "type": "submit",
            "request_id": 5,
            "prompt_token_ids": [1],
            "max_tokens": 1,
            "sampling": {},
            "stop_token_ids": [],
        },
    ),  # request_id not a str
    ("gateway_to_scheduler", {"type": "submit", "request_id": "r"}),  # missing fields
    ("gateway_to_scheduler", {"type": "abort", "request_id": "r", "reason": "x", "extra": 1}),  # unknown field
    (
        "gateway_to_scheduler",
        {
            "type": "submit",
            "request_id": "r",
            "prompt_token_ids": [1.5],
            "max_tokens": 1,
            "sampling": {},
            "stop_token_ids": [],
        },
    ),  # float token id
    (
        "gateway_to_scheduler",
        {
            "type": "submit",
            "request_id": "r",
            "prompt_token_ids": [1],
            "max_tokens": 1,
            "sampling": {"temperature": 0.0, "nucleus": 0.5},
            "stop_token_ids": [],
        },
    ),  # unknown nested field
    ("gateway_to_scheduler", {"request_id": "r", "reason": "x"}),  # no tag at all
    ("gateway_to_scheduler", [1, 2, 3]),  # an array, not a map
    ("gateway_to_scheduler", "abort"),
    (
        "scheduler_to_gateway",
        {
            "type": "tokens",
            "request_id": "r",
            "token_ids": [],
            "finish_reason": "eos",
            "num_prompt_tokens": 1,
            "num_completion_tokens": 0,
        },
    ),  # not a FinishReason
    ("scheduler_to_gateway", {"type": "request_error", "request_id": "r", "code": "NOT_FOUND", "message": ""}),
    (
        "worker_to_scheduler",
        {
            "type": "heartbeat",
            "worker_id": "w0",
            "incarnation": "1",
            "state": "READY",
            "num_used_kv_pages": 0,
            "num_steps": 0,
        },
    ),  # incarnation not an int
    ("worker_to_scheduler", {"type": "hello", "worker_id": "w0", "role": "critic", "incarnation": 1}),
    (
        "worker_to_scheduler",
        {
            "type": "heartbeat",
            "worker_id": "w0",
            "incarnation": 1,
            "state": "SLEEPING",
            "num_used_kv_pages": 0,
            "num_steps": 0,
        },
    ),  # not a lifecycle state
    ("scheduler_to_worker", {"type": "step", "step_id": 1, "incarnation": 1, "seqs": [{"request_id": "r"}]}),
    (
        "scheduler_to_worker",
        {
            "type": "step",
            "step_id": 1,
            "incarnation": 1,
            "seqs": [
                {
                    "request_id": "r",
                    "pages": None,
                    "start_position": 0,
                    "token_ids": [1],
                    "sample": True,
                    "sampling": {},
                }
            ],
        },
    ),  # no pages
]


@pytest.mark.parametrize(
    ("direction", "payload"), WRONG_SCHEMA, ids=[f"{d}-{i}" for i, (d, _) in enumerate(WRONG_SCHEMA)]
)
def test_valid_msgpack_of_the_wrong_schema_raises_validation_error(direction: str, payload: object) -> None:
    with pytest.raises(msgspec.ValidationError):
        codec(direction).decode(msgspec.msgpack.encode(payload))


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("tag", ["bogus", "", "SUBMIT", 3])
def test_an_unknown_tag_raises_validation_error(direction: str, tag: object) -> None:
    with pytest.raises(msgspec.ValidationError):
        codec(direction).decode(msgspec.msgpack.encode({"type": tag, "request_id": "r", "reason": "x"}))


CODECS = [codec(d) for d in DIRECTIONS]


def decode_everywhere(frame: bytes) -> None:
    """Decode with every direction's codec; only DecodeError (ValidationError is one) may escape."""
    for c in CODECS:
        try:
            c.decode(frame)
        except msgspec.DecodeError:
            pass


@settings(max_examples=500)
@given(st.binary(max_size=256))
def test_random_bytes_never_raise_anything_but_decode_error(frame: bytes) -> None:
    decode_everywhere(frame)


TAGS = [tag_of(t) for _, (union, _) in DIRECTIONS.items() for t in typing.get_args(union)]
FIELD_NAMES = sorted(
    {f.name for _, (union, _) in DIRECTIONS.items() for t in typing.get_args(union) for f in msgspec.structs.fields(t)}
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
VALUES = st.recursive(
    SCALARS | st.sampled_from(TAGS),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=4), inner, max_size=6)
    ),
    max_leaves=20,
)
MESSAGE_LIKE = st.builds(
    lambda tag, fields: {"type": tag, **fields},
    st.sampled_from(TAGS),
    st.dictionaries(st.sampled_from(FIELD_NAMES), VALUES, max_size=12),
)


@settings(max_examples=500)
@given(MESSAGE_LIKE | VALUES)
def test_random_msgpack_values_never_raise_anything_but_decode_error(payload: object) -> None:
    decode_everywhere(msgspec.msgpack.encode(payload))


@settings(max_examples=300)
@given(st.sampled_from(ALL_CASES), st.data())
def test_corrupted_real_frames_never_raise_anything_but_decode_error(
    case: tuple[str, msgspec.Struct], data: st.DataObject
) -> None:
    frame = bytearray(codec(case[0]).encode(case[1]))
    for _ in range(data.draw(st.integers(1, 4))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    decode_everywhere(bytes(frame))
