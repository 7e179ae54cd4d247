"""The largest frame each ZeroMQ socket takes (its MAXMSGSIZE): the largest message that may legally come on it.

libzmq reads a frame's size before its body and drops the connection when the size is over
the socket's MAXMSGSIZE, during the CURVE handshake as after it. Without one, a peer that
never completes the handshake makes a process hold a frame of any size while it streams
in; with one, a peer can make it hold one bound's worth per connection at most, for the
handshake's deadline at most (ZMQ_HANDSHAKE_IVL: libzmq's 30 s; the scheduler's sockets 10 s).

A legitimate message must never exceed its socket's bound: the connection it came on would
be dropped. So each bound is the receiver's worst case, counted message by message and
field by field at msgpack's widest (an int or a float 9 bytes, a string 4 bytes a
character, a header 5), every list at the longest the protocol's limits (proto/messages.py)
and the receiver's settings allow; then times SAFETY, and never below FLOOR_BYTES.
tests/unit/test_frames.py builds the largest messages of every direction and checks that
they fit.

What a receiver knows: the scheduler its own settings; a target worker or the draft service
its settings of the same names (`specserve up`, the stack and compose give the scheduler
and the workers the same --max-num-seqs, --max-num-batched-tokens and --max-model-len, and
the scheduler refuses a process whose context is shorter than its own); a gateway none, so
what the scheduler sends it keeps to the protocol's per-frame limits (MAX_DELTAS_PER_FRAME,
MAX_LISTED_PROCESSES, ...).
"""

from __future__ import annotations

import functools
import math
import typing
from dataclasses import dataclass

import msgspec
import msgspec.inspect as mi

from common.step_shape import ROW_KNOTS
from proto import messages as m

SAFETY = 1.5  # over the worst case as counted, for what the count may miss
FLOOR_BYTES = 1 << 20  # no socket takes less: a frame this small costs nothing to hold
HEARTBEAT_SOCKET_BYTES = FLOOR_BYTES  # the scheduler sends nothing to a process's heartbeat socket
FEATURE_ITEM_BYTES = 4  # the widest dtype target features come in (float32)

_NUMBER = 9  # an int or a float at msgpack's widest: a marker and 8 bytes
_HEAD = 5  # a string's, bytes', list's or map's header at its widest


@dataclass(frozen=True)
class FrameLimits:
    """The settings that shape the frames a process is sent, as that process knows them."""

    max_model_len: int  # tokens one sequence holds at most
    max_num_seqs: int  # sequences in one step
    max_num_batched_tokens: int  # tokens of one step, its drafts apart
    max_draft_tokens: int  # draft tokens one sequence's step verifies (proposed, or forced by its grammar)
    max_propose_seqs: int = 0  # sequences in one propose request
    feature_width: int = 0  # values in one row of target features (0: none come)
    kv_page_size: int = 1  # positions per KV page (1: a block table names the most pages)

    @property
    def max_step_tokens(self) -> int:
        """A step's tokens with its drafts: the budget, and what a grammar forces, which each decoding sequence may
        carry beyond it (scheduler/speculation/forced.py, `forced_drafts`)."""
        return self.max_num_batched_tokens + self.max_num_seqs * self.max_draft_tokens

    @property
    def max_block_table_pages(self) -> int:
        """The pages one sequence's block table names: its positions and its drafts, and one more."""
        return math.ceil((self.max_model_len + self.max_draft_tokens) / self.kv_page_size) + 1


# ---------------------------------------------------------------- the bound of each socket


@functools.cache
def gateway_to_scheduler(max_model_len: int) -> int:
    """The scheduler's gateway socket, for a scheduler of `max_model_len` (a gateway checks what it sends against it:
    a frame over it is a request the scheduler would refuse anyway)."""
    return _bound(
        m.GatewayToScheduler,
        {
            m.SubmitRequest: _struct(
                m.SubmitRequest,
                request_id=_REQUEST_ID,
                prompt_token_ids=_ints(max_model_len),
                sampling=_sampling(),
                stop_token_ids=_ints(m.MAX_STOP_TOKEN_IDS),
                grammar=_text(m.MAX_GRAMMAR_CHARS),
                cache_salt=_text(m.MAX_CACHE_SALT_CHARS),
                tenant=_text(m.MAX_TENANT_CHARS),
            ),
            m.AbortRequest: _struct(m.AbortRequest, request_id=_REQUEST_ID, reason=_REASON),
            m.InfoQuery: _struct(m.InfoQuery),
            # gateway_id is a ZeroMQ routing id (255 bytes at most), incarnation a name the gateway makes at its start.
            m.GatewayHello: _struct(m.GatewayHello, gateway_id=_NAME, incarnation=_NAME),
            m.GatewayHeartbeat: _struct(m.GatewayHeartbeat, gateway_id=_NAME, incarnation=_NAME),
        },
    )


@functools.cache
def scheduler_to_gateway() -> int:
    """A gateway's socket: only the protocol's per-frame limits bound it (the scheduler keeps to them)."""
    num_tokens = m.MAX_DRAFT_TOKENS + 1  # a step's new tokens of one request: its accepted drafts and one more
    delta = _struct(
        m.TokenDelta,
        request_id=_REQUEST_ID,
        token_ids=_ints(num_tokens),
        logprobs=_logprobs(num_tokens),
        prompt_logprobs=_logprobs(m.MAX_PROMPT_LOGPROBS_PER_DELTA),
    )
    process = _struct(
        m.ProcessInfo,
        process_id=_NAME,
        failure=_REASON,
        protocol_errors=_ERROR_COUNTS,
        kernels=_text(m.MAX_KERNELS_CHARS),
        graphs=_text(m.MAX_KERNELS_CHARS),
        step_ms_per_row_by_range=_ints(len(ROW_KNOTS) + 1),
    )
    by_draft_position = _HEAD + (m.MAX_DRAFT_TOKENS + 1) * 2 * _NUMBER
    source = _struct(m.SourceAcceptance, recent_rates=_ints(m.MAX_DRAFT_TOKENS))
    sources = _HEAD + len(m.PROPOSAL_SOURCES) * (_text(max(map(len, m.PROPOSAL_SOURCES))) + source)
    speculation = _struct(
        m.SpeculationInfo,
        steps_by_k=by_draft_position,
        proposed_by_position=by_draft_position,
        accepted_by_position=by_draft_position,
        sources=sources,
        policy=_NAME,
    )
    return _bound(
        m.SchedulerToGateway,
        {
            m.TokenDelta: delta,
            m.TokenDeltas: _struct(m.TokenDeltas, deltas=_list(m.MAX_DELTAS_PER_FRAME, delta)),
            m.RequestError: _struct(m.RequestError, request_id=_REQUEST_ID, message=_REASON),
            # The scheduler's own protocol errors are a few kinds named in its code,
            # as MAX_ERROR_KINDS bounds a process's.
            m.InfoReply: _struct(
                m.InfoReply,
                model_name=_NAME,
                processes=_list(m.MAX_LISTED_PROCESSES, process),
                speculation=speculation,
                protocol_errors=_ERROR_COUNTS,
            ),
            m.Probe: _struct(m.Probe),
        },
    )


@functools.cache
def worker_to_scheduler(limits: FrameLimits) -> int:
    """The scheduler's worker socket: a step's result (its feature rows the largest part), a proposal, a report."""
    k = limits.max_draft_tokens
    output = _struct(
        m.SeqOutput,
        request_id=_REQUEST_ID,
        token_ids=_ints(k + 1),
        accepted_nodes=_ints(k),
        logprobs=_logprobs(k + 1),
        forced_token_ids=_ints(m.MAX_DRAFT_TOKENS),
    )  # a worker cuts those
    rows = _struct(m.FeatureRows, dtype=_DTYPE, data=_HEAD)  # the data counted for the whole step below
    feature_bytes = limits.max_step_tokens * limits.feature_width * FEATURE_ITEM_BYTES
    prompt_entries = limits.max_num_batched_tokens * _logprob()  # a chunk's tokens, each scored once
    step_result = _struct(
        m.StepResult,
        worker_id=_NAME,
        outputs=_list(limits.max_num_seqs, output),
        features=_list(limits.max_num_seqs, _struct(m.SeqFeatures, request_id=_REQUEST_ID, rows=rows)) + feature_bytes,
        prompt_logprobs=_list(limits.max_num_seqs, _struct(m.PromptLogprobs, request_id=_REQUEST_ID, entries=_HEAD))
        + prompt_entries,
    )
    proposal = _struct(
        m.Proposal,
        request_id=_REQUEST_ID,
        token_ids=_ints(k),
        dists=_list(k, _sparse_dist()),
        parents=_ints(k),
        source=_NAME,
        chances=_ints(k),  # floats: as wide as ints at msgpack's widest
    )
    return _bound(
        m.WorkerToScheduler,
        {
            m.WorkerHello: _struct(m.WorkerHello, **{name: _NAME for name in m.HELLO_NAMES}),
            m.LifecycleReport: _struct(
                m.LifecycleReport,
                worker_id=_NAME,
                kernels=_text(m.MAX_KERNELS_CHARS),
                graphs=_text(m.MAX_KERNELS_CHARS),
                step_timings=_list(m.MAX_STEP_TIMINGS, _struct(m.StepTiming)),
            ),
            m.WorkerFailed: _struct(m.WorkerFailed, worker_id=_NAME, error_type=_NAME, message=_REASON),
            m.Heartbeat: _struct(m.Heartbeat, worker_id=_NAME, protocol_errors=_ERROR_COUNTS),
            m.StepResult: step_result,
            m.StepRefused: _struct(m.StepRefused, worker_id=_NAME, reason=_REASON, request_id=_REQUEST_ID),
            m.ProposeResult: _struct(
                m.ProposeResult, worker_id=_NAME, proposals=_list(limits.max_propose_seqs, proposal)
            ),
            m.ProposeRefused: _struct(m.ProposeRefused, worker_id=_NAME, reason=_REASON),
        },
    )


@functools.cache
def scheduler_to_target(limits: FrameLimits) -> int:
    """A target worker's socket: a step, each sequence with its sampling, block table, history and grammar."""
    k = limits.max_draft_tokens
    seq = _struct(
        m.SeqWork,
        request_id=_REQUEST_ID,
        pages=_ints(limits.max_block_table_pages),
        token_ids=_HEAD,
        sampling=_sampling(),
        draft_dists=_list(k, _sparse_dist()),
        draft_parents=_ints(k),
        history=_ints(limits.max_model_len),
        grammar=_text(m.MAX_GRAMMAR_CHARS),
    )
    step = _struct(m.StepRequest, seqs=_list(limits.max_num_seqs, seq) + limits.max_step_tokens * _NUMBER)
    return _bound(m.SchedulerToWorker, {m.StepRequest: step, m.Drain: _struct(m.Drain), m.Probe: _struct(m.Probe)})


@functools.cache
def scheduler_to_draft(limits: FrameLimits) -> int:
    """The draft service's socket: a propose request, each sequence with its tokens and the feature rows it lacks."""
    rows = _struct(
        m.FeatureRows, dtype=_DTYPE, data=_HEAD + limits.max_model_len * limits.feature_width * FEATURE_ITEM_BYTES
    )
    seq = _struct(
        m.ProposeSeq,
        request_id=_REQUEST_ID,
        new_token_ids=_ints(limits.max_model_len),
        sampling=_sampling(),
        features=rows,
        tenant=_text(m.MAX_TENANT_CHARS),
    )
    return _bound(
        m.SchedulerToDraft,
        {
            m.ProposeRequest: _struct(m.ProposeRequest, seqs=_list(limits.max_propose_seqs, seq)),
            m.ReleaseSequences: _struct(m.ReleaseSequences, request_ids=_list(m.MAX_RELEASE_IDS, _REQUEST_ID)),
            m.RecordText: _struct(
                m.RecordText, tenant=_text(m.MAX_TENANT_CHARS), token_ids=_ints(limits.max_model_len)
            ),
            m.Drain: _struct(m.Drain),
            m.Probe: _struct(m.Probe),
        },
    )


# ---------------------------------------------------------------- counting


def _text(num_chars: int) -> int:
    return _HEAD + 4 * num_chars  # UTF-8: 4 bytes a character at most


def _ints(count: int) -> int:
    return _HEAD + count * _NUMBER


def _list(count: int, item_bytes: int) -> int:
    return _HEAD + count * item_bytes


_REQUEST_ID = _text(m.MAX_REQUEST_ID_CHARS)
_NAME = _text(m.MAX_NAME_CHARS)
_REASON = _text(m.MAX_REASON_CHARS)
_DTYPE = _text(16)  # a torch dtype's name ("bfloat16")
_ERROR_COUNTS = _HEAD + m.MAX_ERROR_KINDS * (_text(m.MAX_ERROR_KIND_CHARS) + _NUMBER)


def _logprob() -> int:
    return _struct(m.TokenLogprob, top=_list(m.MAX_TOP_LOGPROBS, _struct(m.TopLogprob)))


def _logprobs(count: int) -> int:
    return _list(count, _logprob())


def _sampling() -> int:
    penalties = _struct(
        m.Penalties,
        logit_bias=_HEAD + m.MAX_LOGIT_BIAS_ENTRIES * 2 * _NUMBER,
        stop_token_ids=_ints(m.MAX_STOP_TOKEN_IDS),
    )
    return _struct(m.SamplingParams, penalties=penalties)


def _sparse_dist() -> int:
    return _struct(m.SparseDist, token_ids=_ints(m.MAX_SPARSE_DIST_TOKENS), probs=_ints(m.MAX_SPARSE_DIST_TOKENS))


def _struct(cls: type[msgspec.Struct], **sizes: int) -> int:
    """`cls` encoded at its largest: each field named in `sizes` at that many bytes, each other one a scalar (an int,
    a float, a bool, None, a literal). A field of any other kind must be named: TypeError says which (so a field
    added to a message is counted, or this fails)."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    total = _HEAD
    if info.tag is not None:
        total += _HEAD + len(str(info.tag_field)) + _HEAD + len(str(info.tag))
    for field in info.fields:
        key = 0 if info.array_like else _HEAD + len(field.encode_name)
        size = sizes.pop(field.name) if field.name in sizes else _scalar(field.type)
        if size is None:
            raise TypeError(f"{cls.__name__}.{field.name} is not a scalar: give its size")
        total += key + size
    if sizes:
        raise TypeError(f"{cls.__name__} has no field {', '.join(sorted(sizes))}")
    return total


def _scalar(kind: mi.Type) -> int | None:
    """The largest encoding of a scalar type; None for any other."""
    match kind:
        case mi.IntType() | mi.FloatType():
            return _NUMBER
        case mi.BoolType() | mi.NoneType():
            return 1
        case mi.LiteralType(values=values):
            return max(_text(len(v)) if isinstance(v, str) else _NUMBER for v in values)
        case mi.EnumType(cls=enum_cls):
            return max(_text(len(str(member.value))) for member in enum_cls)
        case mi.UnionType(types=types):
            sizes = [_scalar(t) for t in types]
            return None if None in sizes else max(size for size in sizes if size is not None)
        case _:
            return None


def _bound(union: object, sizes: dict[type, int]) -> int:
    """The bound of a socket receiving `union`: every message of it counted (TypeError names one that is not)."""
    if missing := set(typing.get_args(union)) - set(sizes):
        raise TypeError(f"no size counted for {', '.join(sorted(t.__name__ for t in missing))}")
    return max(FLOOR_BYTES, math.ceil(SAFETY * max(sizes.values())))
