"""Every internal message between specserve processes: frozen, tagged msgspec Structs.

Two conversations, each over one ZeroMQ ROUTER socket bound by the scheduler:

- gateway <-> scheduler: `GatewayToScheduler` in, `SchedulerToGateway` out;
- worker  <-> scheduler: `WorkerToScheduler` in, `SchedulerToWorker` out to target
  workers, `SchedulerToDraft` out to the draft service (both roles share the socket).

Every message is one msgpack frame whose tag names its type. Token ids are ints in the
model's vocabulary; positions are 0-based indices into a sequence (prompt then output).
"""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

import msgspec

from proto.lifecycle import State

# 2: target features for draft heads; 3: token trees; 4: a READY report may lower max_draft_tokens;
# 5: lifecycle states typed, a step output names the draft nodes it accepted;
# 6: a paged KV cache (a step names each sequence's pages; cached prompt tokens in usage);
# 9: a READY report names the kernels its model runs on (a receiver refuses fields it does not know);
# 10: log-probabilities of sampled and prompt tokens;
# 11: gateways heartbeat (GatewayHeartbeat) and are probed (Probe); InfoReply counts the gateways given up on.
PROTOCOL_VERSION = 12

# The most alternatives a log-probability may list with the token it is for (OpenAI's top_logprobs limit).
MAX_TOP_LOGPROBS = 20

Role = Literal["target", "draft"]

# A temperature below this is greedy: dividing logits by it overflows float32 (a softmax of
# infinities is NaN), and its draws are the argmax anyway.
GREEDY_BELOW = 1e-5


MAX_PENALTY = 2.0  # presence and frequency penalties, either sign (OpenAI's range)
# A logit of a token seen before is divided by the repetition penalty if positive, else multiplied by it: in
# [1/100, 100] a logit moves by at most 100 times, far inside float32 for any model's logits. A smaller penalty made
# them infinite (1e-300 is 0 in float32), and every log-probability NaN.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# Logits are divided by the temperature: past this, every token is about as likely as any other anyway.
MAX_TEMPERATURE = 1e4
MAX_LOGIT_BIAS = 100.0  # either sign (OpenAI's range)
MAX_LOGIT_BIAS_ENTRIES = 1024

# Sizes every message keeps to, whoever sends it: a receiver refuses more (or cuts it, where said), and proto/frames.py
# sizes the largest frame each socket takes from them.
MAX_REQUEST_ID_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1  # a request's priority: what the gRPC API's int32 holds
MAX_GRAMMAR_CHARS = 1 << 20
MAX_CACHE_SALT_CHARS = 512  # a client's salt (at most 256) with the gateway's own before it
MAX_NAME_CHARS = 256  # a hello's ids, names, fingerprints, dtype and device
MAX_KERNELS_CHARS = (
    1024  # a READY report's kernels beyond this are cut (they go into GetServerInfo and /metrics labels)
)
MAX_REASON_CHARS = (
    2048  # a failure's or a refusal's text: its sender cuts it here, and so does the scheduler relaying it
)
# Proposal.source values the scheduler keeps apart ("other": any it does not know; "": unsaid).
PROPOSAL_SOURCES = ("", "lookup", "phrases", "suffix", "head", "model", "grammar", "other")
MAX_STEP_TIMINGS = 16  # warm-up step timings a READY report carries at most
MAX_DRAFT_TOKENS = 64  # draft tokens one sequence's step verifies (a hello claiming more is refused)
# The widest target features (hidden states) a process may return or read: Llama 3.1 405B's, the widest model of the
# families modeling/ implements. Feature rows are the largest frames on the scheduler's worker socket.
MAX_FEATURE_WIDTH = 1 << 14
MAX_SPARSE_DIST_TOKENS = 1024  # tokens a draft's sampled distribution lists (the draft service's --draft-top-k)
# What the scheduler sends a gateway in one frame, so that a gateway (which knows none of the scheduler's settings) can
# bound it: more deltas go in several TokenDeltas, a longer chunk's prompt log-probabilities in several deltas, and
# GetServerInfo lists this many processes, each with this many kinds of protocol error it reported.
MAX_DELTAS_PER_FRAME = 64
MAX_PROMPT_LOGPROBS_PER_DELTA = 256
MAX_LISTED_PROCESSES = 256
MAX_ERROR_KINDS = 32
MAX_ERROR_KIND_CHARS = 64
MAX_RELEASE_IDS = 1024  # request ids one ReleaseSequences names (more go in several)
MAX_TENANT_CHARS = 64  # a request's tenant (SubmitRequest.tenant): a gateway's digest, never a secret
COMPLETION_LEAD_IN = 32  # a completion's RecordText begins with its prompt's last tokens, up to this many


class Penalties(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What changes a request's logits before it samples (modeling/sampling/penalties.py),
    in this order: stop tokens held back
    until min_tokens, logit_bias added, then repetition, frequency and presence penalties."""

    presence: float = 0.0  # subtracted from the logit of every token the completion holds, in -2 .. 2
    frequency: float = 0.0  # subtracted once for each time the completion holds the token, in -2 .. 2
    repetition: float = 1.0  # a logit of a token the prompt or completion holds: divided by it if positive, else times
    logit_bias: dict[int, float] = {}  # token id -> added to its logit, in -100 .. 100
    min_tokens: int = 0  # completion tokens before any of stop_token_ids may be generated
    stop_token_ids: list[int] = []  # the request's stop tokens (eos unless ignored), held back by min_tokens


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How to pick the next token. A temperature below GREEDY_BELOW (0 included) means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 = no top-k cut
    min_p: float = 0.0  # tokens less likely than min_p times the likeliest are cut, in [0, 1]; 0 = no cut
    seed: int = 0  # always set: the scheduler draws one when the client gave none
    penalties: Penalties | None = None  # None: the logits as the model gives them

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


class TopLogprob(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    token_id: int
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One token's log-probability where it stands, and the likeliest tokens there (likeliest first).

    The distribution is the target model's after temperature (a greedy request's, and a
    prompt's: the model's own), before any top-k or top-p cut.
    """

    logprob: float
    top: list[TopLogprob]


# ---------------------------------------------------------------- gateway -> scheduler


class SubmitRequest(msgspec.Struct, tag="submit", frozen=True, forbid_unknown_fields=True):
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int | None  # completion tokens at most; None = until the context is full
    sampling: SamplingParams
    stop_token_ids: list[int]  # finish (reason "stop") when one is generated; eos is here unless ignore_eos
    seed_given: bool = True  # False: the scheduler replaces sampling.seed with a random one
    # Log-probabilities: None asks for none; n >= 0 asks for each token's with its n likeliest alternatives.
    logprobs: int | None = None  # of every completion token
    prompt_logprobs: int | None = None  # of every prompt token but the first; max_tokens may then be 0
    # A request resumed on a new scheduler: the last resumed_tokens of prompt_token_ids are completion tokens it had
    # already streamed (penalties and the grammar count them as the completion's).
    resumed_tokens: int = 0
    # The grammar its completion follows (llguidance's text, common/text/structured.py); None: any text.
    grammar: str | None = None
    # Its prefix-cache pages are shared only with requests of the same salt ("": the cache every unsalted request
    # shares); the gateway sets it (see its --prefix-cache-scope).
    cache_salt: str = ""
    # Under the scheduler's --scheduling-policy priority, lower runs first and is preempted last (vLLM's meaning); a
    # scheduler that serves first come, first served refuses any other value than 0.
    priority: int = 0
    # Whose text a draft that learns from traffic may draft from for it, and whose its text becomes (the draft
    # service's --suffix-scope): the gateway's name for the caller ("": the one tenant of callers it cannot tell apart).
    tenant: str = ""


class AbortRequest(msgspec.Struct, tag="abort", frozen=True, forbid_unknown_fields=True):
    """Stop a request and free its KV; the scheduler sends nothing more for it."""

    request_id: str
    reason: str  # why, for the log: "client_cancelled", "stop_string", ...


class InfoQuery(msgspec.Struct, tag="info_query", frozen=True, forbid_unknown_fields=True):
    query_id: int
    # First forget every prefix-cache page no request holds, on every target (what the reply then shows).
    flush_prefix_cache: bool = False


class GatewayHello(msgspec.Struct, tag="gateway_hello", frozen=True, forbid_unknown_fields=True):
    gateway_id: str
    protocol_version: int
    # A name of the gateway process, new at each start: a greeting with another one from the same routing identity
    # (a gateway restarted with the same --gateway-id) is a new process, which cannot resume its predecessor's requests.
    incarnation: str = ""


# How often a gateway says GatewayHeartbeat; the scheduler's --heartbeat-timeout-s must be well above it.
GATEWAY_HEARTBEAT_INTERVAL_S = 1.0


class GatewayHeartbeat(msgspec.Struct, tag="gateway_heartbeat", frozen=True, forbid_unknown_fields=True):
    """A gateway is alive, every GATEWAY_HEARTBEAT_INTERVAL_S. It says what the hello says, so a gateway the scheduler
    gave up on while its connection stayed up (silent too long) is known again without a new connection."""

    gateway_id: str
    protocol_version: int
    incarnation: str = ""


GatewayToScheduler = SubmitRequest | AbortRequest | InfoQuery | GatewayHello | GatewayHeartbeat


# ---------------------------------------------------------------- scheduler -> gateway


FinishReason = Literal["stop", "length", "abort"]
ErrorCode = Literal["INVALID_ARGUMENT", "UNAVAILABLE", "RESOURCE_EXHAUSTED", "INTERNAL"]


class TokenDelta(msgspec.Struct, tag="tokens", frozen=True, forbid_unknown_fields=True):
    """New tokens of one request, in order; the last delta of a request has finish_reason."""

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_completion_tokens: int  # completion tokens so far, these included
    # Speculation so far for this request (cumulative, so any delta can close the usage).
    num_draft_tokens: int = 0  # draft tokens sent to verification
    num_accepted_draft_tokens: int = 0
    num_verify_steps: int = 0  # target steps that verified at least one draft token
    num_cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    logprobs: list[TokenLogprob] | None = None  # when asked: one per token id
    # When asked: the next prompt tokens' (the first delta with any starts at the prompt's second token).
    prompt_logprobs: list[TokenLogprob] | None = None


class TokenDeltas(msgspec.Struct, tag="token_deltas", frozen=True, forbid_unknown_fields=True):
    """The deltas for one gateway from one scheduler event (a step's results), in order:
    one frame, not one per request."""

    deltas: list[TokenDelta]


class RequestError(msgspec.Struct, tag="request_error", frozen=True, forbid_unknown_fields=True):
    """The request ended without (further) output; code maps to a gRPC status."""

    request_id: str
    code: ErrorCode
    message: str


class ProcessInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    process_id: str
    role: Role
    state: State
    incarnation: int
    heartbeat_age_s: float
    num_used_kv_pages: int  # held by sequences or by the prefix cache (a target's as the scheduler assigns them)
    num_kv_pages: int
    kv_page_size: int
    num_running: int  # sequences the scheduler has placed on it
    failure: str  # "" unless FAILED/DEAD: the phase and the cause
    protocol_errors: dict[str, int] = {}  # messages it dropped since it started, by kind, as last reported
    num_cached_kv_pages: int = 0  # of the used pages, those only the prefix cache holds (taken back when needed)
    prefix_cache_queried_tokens: int = 0  # prompt tokens looked up in its prefix cache since it was READY
    prefix_cache_hit_tokens: int = 0  # of those, found cached
    num_preemptions: int = 0  # sequences preempted (recomputed later) for lack of pages
    kernels: str = ""  # which kernels its model runs on, as its READY report said ("": not READY yet, or no model)
    # A target's step time as the scheduler fitted it to its steps (scheduler/speculation/cost.py): a fixed part, per
    # decode or verify row, per prefill token, per thousand attended positions; and how far off the fit has been
    # lately. All 0 until it has seen enough steps.
    num_costed_steps: int = 0
    step_fixed_ms: float = 0.0
    step_ms_per_row: float = 0.0
    step_ms_per_prefill_token: float = 0.0
    step_ms_per_kilo_context: float = 0.0
    step_cost_error_ms: float = 0.0
    # Decode rows cost by how many a step has: ms per row up to 8, from 9 to 32, beyond 32 (step_ms_per_row: the first).
    step_ms_per_row_by_range: list[float] = []
    step_ms_per_constrained_row: float = 0.0  # what a row under a grammar costs more (its token mask)
    step_predicted_ms: float = 0.0  # moving averages, over the same steps, of the time predicted and measured
    step_measured_ms: float = 0.0
    # A target's READY report: whether its steps are batch invariant (greedy verification then gives exactly plain
    # decoding's answer; else drafts are verified lossless in distribution). None: not said (not READY, a draft).
    batch_invariant: bool | None = None
    graphs: str = ""  # a target's READY report: its captured graphs, or why it serves without them ("": not said)


class SourceAcceptance(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One proposer source's drafts since the scheduler started, and its recent acceptance per position."""

    num_verify_steps: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    # Per draft position: how often a token there is accepted given the ones before it were, over the recent
    # verify steps (what the speculation policy starts each request from).
    recent_rates: list[float] = []


class SpeculationInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Server-wide speculation counters since the scheduler started."""

    num_draft_tokens: int  # proposed tokens sent to verification
    num_accepted_draft_tokens: int
    num_verify_steps: int  # per sequence: verify passes with at least one draft token
    num_plain_decode_steps: int  # per sequence: decode passes without a draft
    acceptance_rate: float  # accepted / proposed, 0 when nothing was proposed
    mean_accepted_length: float  # accepted draft tokens per verify step (the bonus token not counted)
    steps_by_k: dict[int, int] = msgspec.field(default_factory=dict)  # target steps by the k chosen (0: plain decode)
    # Per draft position (0: the first draft token; in a tree, the depth below the sequence's last token): verify
    # steps that proposed a token there, and those that accepted one there (so the acceptance at position i given
    # i - 1 is accepted[i] / accepted[i - 1]).
    proposed_by_position: dict[int, int] = msgspec.field(default_factory=dict)
    accepted_by_position: dict[int, int] = msgspec.field(default_factory=dict)
    # What a proposal costs lately (moving averages): the draft service's own time, the wait from sending the
    # propose request to its answer, and what waiting for proposals added to a target's idle time between a step's
    # planning and its result (the policy's price of an ask).
    propose_ms: float = 0.0
    propose_wait_ms: float = 0.0
    ask_ms: float = 0.0
    # Per proposer source ("lookup", "phrases", "head", "model", "grammar": forced by a request's grammar).
    sources: dict[str, SourceAcceptance] = msgspec.field(default_factory=dict)
    policy: str = ""  # --speculation-policy


class InfoReply(msgspec.Struct, tag="info", frozen=True, forbid_unknown_fields=True):
    query_id: int
    model_name: str
    max_model_len: int
    num_waiting: int
    num_running: int
    processes: list[ProcessInfo]
    speculation: SpeculationInfo | None = None
    # Messages the scheduler dropped since it started, by socket and kind ("worker.decode", "gateway.unknown_sender").
    protocol_errors: dict[str, int] = {}
    num_gateways: int = 0  # gateways the scheduler knows now (connected, or gone for less than --gateway-gone-grace-s)
    num_gone_gateways: int = 0  # gateways given up on since it started: gone for longer than --gateway-gone-grace-s
    num_orphaned_requests: int = 0  # requests aborted since it started because their gateway was given up on


class Probe(msgspec.Struct, tag="probe", frozen=True, forbid_unknown_fields=True):
    """Nothing to do: the scheduler sent it only to learn whether this process's connection is still there."""


SchedulerToGateway = TokenDelta | TokenDeltas | RequestError | InfoReply | Probe


# ---------------------------------------------------------------- scheduler -> worker


class SparseDist(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """A distribution over a few tokens (all others have probability 0): what a draft sampled from."""

    token_ids: list[int]
    probs: list[float]


class FeatureRows(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A target's final hidden states at consecutive positions, raw: row-major `num_rows` x `width` values of `dtype`.

    What an EAGLE-style draft head reads (modeling/model/eagle.py); the scheduler only moves the bytes.
    """

    start_position: int
    num_rows: int
    width: int
    dtype: str  # a torch dtype name: "bfloat16", "float32", "float16"
    data: bytes


class SeqWork(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One sequence's part of a step: write token_ids' keys and values at start_position on, then maybe sample.

    `pages` is the sequence's block table: the KV pages holding its positions in order
    (position p in pages[p // page_size]), reaching past its last new token. Its pages
    before start_position hold the sequence's keys and values (the scheduler's word: a
    prefix-cache hit's pages were written by another request). No two sequences of a step
    write the same page (the worker checks). If `sample` is set the worker returns one new
    token (plus, when verifying, the accepted draft tokens); otherwise this was a non-final
    prefill chunk.
    """

    request_id: str
    pages: list[int]
    start_position: int
    token_ids: list[int]
    sample: bool
    sampling: SamplingParams
    num_draft_tokens: int = 0  # trailing entries of token_ids that are unverified proposals
    # When sampling: the distribution each draft token was drawn from, one per draft token.
    # None: the proposer is deterministic (each draft token had probability 1).
    draft_dists: list[SparseDist] | None = None
    # The draft tokens as a token tree (point masses, no draft_dists): each one's parent among
    # them, always an earlier one, or -1 for the token before them. None: one chain.
    draft_parents: list[int] | None = None
    logprobs: int = -1  # >= 0: the new tokens' log-probabilities come back, with this many alternatives
    # >= 0: so do those of the tokens after each of token_ids but the drafts (the last: after_token_id).
    prompt_logprobs: int = -1
    after_token_id: int = -1  # the prompt token after this chunk, when prompt_logprobs asks for its log-probability
    # With sampling.penalties or a grammar, when it samples: the sequence's tokens before start_position (prompt, then
    # completion), and how many are the prompt's; the worker keeps no tokens, and both read them.
    history: list[int] | None = None
    num_prompt_tokens: int = 0
    grammar: str | None = None  # when it samples: the grammar its completion follows (every row is masked by it)


class StepRequest(msgspec.Struct, tag="step", frozen=True, forbid_unknown_fields=True):
    step_id: int
    incarnation: int  # of the worker this step is meant for; any other incarnation refuses it
    seqs: list[SeqWork]
    # Return the final hidden state of every token that stands after the step (a draft head reads them).
    return_features: bool = False


class Drain(msgspec.Struct, tag="drain", frozen=True, forbid_unknown_fields=True):
    """Finish the step in flight, then stop."""

    incarnation: int


SchedulerToWorker = StepRequest | Drain | Probe


# ---------------------------------------------------------------- scheduler -> draft service


class ProposeSeq(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One sequence of a propose request.

    The draft service first drops the last `num_drop` tokens it holds for the sequence
    (its rejected proposals), then appends `new_token_ids` (what was accepted since; the
    whole sequence the first time), then proposes up to `num_tokens` continuation tokens.
    `num_held` is how many tokens it should hold before appending: a mismatch means the
    two sides disagree, and the service starts the sequence over (it proposes nothing
    and answers num_held 0, so the next request sends the whole sequence).
    """

    request_id: str
    num_held: int
    num_drop: int
    new_token_ids: list[int]
    num_tokens: int  # k, at least 1
    sampling: SamplingParams  # greedy requests get greedy proposals; sampled ones a sparse q
    # For a draft that reads target features: the rows from `features.start_position` up to
    # the one before the last token (the service keeps every earlier row it was sent).
    features: FeatureRows | None = None
    tenant: str = ""  # the request's (SubmitRequest.tenant): a draft that learns from traffic drafts from its text


class ProposeRequest(msgspec.Struct, tag="propose", frozen=True, forbid_unknown_fields=True):
    propose_id: int
    incarnation: int  # of the draft service it is meant for
    seqs: list[ProposeSeq]


class ReleaseSequences(msgspec.Struct, tag="release_seqs", frozen=True, forbid_unknown_fields=True):
    """Forget these sequences (finished, aborted): their draft KV is free again."""

    incarnation: int
    request_ids: list[str]


class RecordText(msgspec.Struct, tag="record_text", frozen=True, forbid_unknown_fields=True):
    """Text the server read or wrote, for a draft that learns from traffic (its hello's learns_from_traffic): a
    request's prompt as it is admitted, its completion as it finishes, each its tenant's."""

    incarnation: int
    tenant: str
    token_ids: list[int]  # at most the scheduler's --max-model-len (a longer prompt's end)


SchedulerToDraft = ProposeRequest | ReleaseSequences | RecordText | Drain | Probe


# ---------------------------------------------------------------- worker -> scheduler


# The most KV pages a process may have (the scheduler keeps a record of each of a target's pages): a worker caps its
# pool here, and the scheduler refuses a hello claiming more.
MAX_KV_PAGES = 1 << 21


def worker_identity(worker_id: str, incarnation: int) -> bytes:
    """The routing identity of a process's main socket: its own to each incarnation, so that a restarted process never
    reuses one still held by its predecessor's connection (the scheduler's socket ignores a second connection with
    an identity in use)."""
    return f"{worker_id}/{incarnation}".encode()


def heartbeat_identity(main_identity: bytes) -> bytes:
    """The routing identity of a process's heartbeat socket: heartbeats (and the watchdog's WorkerFailed) come from
    their own thread and socket, which the scheduler believes for those two messages only."""
    return main_identity + b"/heartbeat"


class WorkerHello(msgspec.Struct, tag="hello", frozen=True, forbid_unknown_fields=True):
    """First message of every process incarnation; everything here is known before loading."""

    worker_id: str
    role: Role
    incarnation: int  # larger for every restart; older incarnations' messages are dropped
    protocol_version: int
    pid: int
    model_name: str
    model_fingerprint: str  # hash of the config and the weight file's tensor index
    vocab_size: int
    max_model_len: int  # tokens per sequence at most
    num_kv_pages: int  # its KV cache: pages of kv_page_size positions (a target's sized from its memory budget)
    kv_page_size: int
    dtype: str
    device: str
    vocab_fingerprint: str = ""  # hash of the tokenizer's vocabulary; "" = works on any vocabulary (n-gram)
    max_draft_tokens: int = 0  # target: the longest proposal a verify step may carry; draft: the longest it makes
    # Target: the width of the features it returns. Draft: the width it reads (0: it reads none).
    feature_width: int = 0
    target_fingerprint: str = ""  # draft: the model_fingerprint of the only target it serves ("": any)
    draft_kind: str = ""  # draft: its proposer's kind (common.draft_spec.DraftKind), whence speculation's default caps
    learns_from_traffic: bool = False  # draft: it drafts from the text served (RecordText tells it)


# The hello's text fields, each at most MAX_NAME_CHARS (the scheduler refuses a longer one; proto/frames.py sizes them).
HELLO_NAMES = (
    "worker_id",
    "model_name",
    "model_fingerprint",
    "dtype",
    "device",
    "vocab_fingerprint",
    "target_fingerprint",
    "draft_kind",
)


class StepTiming(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A step's shape (scheduler/speculation/cost.py) and how long it took."""

    decode_rows: int
    prefill_tokens: int
    attended: int
    duration_ms: float


class LifecycleReport(msgspec.Struct, tag="lifecycle", frozen=True, forbid_unknown_fields=True):
    worker_id: str
    incarnation: int
    state: State  # the state just entered
    previous_state: State
    previous_duration_s: float  # time spent in previous_state
    # With READY, a target that found on warming up that it can verify fewer draft tokens
    # than its hello said: the new limit. 0: its steps are not batch invariant
    # (modeling/kernels/invariance.py), so verification would not be lossless and it serves
    # without speculation. None: the hello's limit stands.
    max_draft_tokens: int | None = None
    # With READY: which kernels its model runs on, as its model engine says ("native (linear
    # kernel: avx2)", or "torch (...)" with the reason); "" when it runs no model (a lookup draft).
    kernels: str = ""
    # With READY, a target: whether its steps are batch invariant (a row's logits do not depend on
    # the rows beside it; modeling/kernels/invariance.py), so greedy verification gives exactly plain
    # decoding's answer. None: not said (a draft service).
    batch_invariant: bool | None = None
    # With READY, a target: steps it timed while warming up, so the scheduler's cost model knows
    # what rows cost before its first speculative step.
    step_timings: list[StepTiming] = []
    # With READY, a target: its captured graphs (modeling/model/graphs.py), as it says: "off",
    # "27 graphs (cuda), 412 MiB pool, captured in 3.1 s", or "fallback: eager (why the capture failed)".
    graphs: str = ""


class WorkerFailed(msgspec.Struct, tag="failed", frozen=True, forbid_unknown_fields=True):
    worker_id: str
    incarnation: int
    phase: State  # the state it was in when it failed
    error_type: str
    message: str


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True, forbid_unknown_fields=True):
    worker_id: str
    incarnation: int
    state: State
    num_used_kv_pages: int  # pages its own caches hold (the draft's; a target's pages are the scheduler's to count: 0)
    num_steps: int
    protocol_errors: dict[str, int] = {}  # messages it dropped since it started, by kind


class SeqOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: str
    token_ids: list[int]  # new tokens in order: accepted drafts, then one sampled token
    # The draft nodes accepted, root to leaf: indices into the proposal (a chain's first ones).
    accepted_nodes: list[int] = []
    logprobs: list[TokenLogprob] | None = None  # when asked: one per token id
    # With a grammar: the tokens it forces after these (the next step's draft tokens), and whether it is complete
    # (it allowed nothing more, and end-of-sequence came).
    forced_token_ids: list[int] = []
    grammar_complete: bool = False

    @property
    def num_accepted_draft(self) -> int:
        return len(self.accepted_nodes)


class PromptLogprobs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The log-probabilities of a chunk's tokens after its first (then of after_token_id), as its SeqWork asked."""

    request_id: str
    first_position: int  # the position of the token the first entry is for
    entries: list[TokenLogprob]


class SeqFeatures(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: str
    rows: FeatureRows  # the positions of the step that stand: every new token but rejected drafts


class StepResult(msgspec.Struct, tag="step_result", frozen=True, forbid_unknown_fields=True):
    worker_id: str
    incarnation: int
    step_id: int
    outputs: list[SeqOutput]  # one per SeqWork with sample=True, in request order
    duration_ms: float
    features: list[SeqFeatures] = []  # when asked (return_features): one per SeqWork, in request order
    prompt_logprobs: list[PromptLogprobs] = []  # one per SeqWork that asked, in request order


class StepRefused(msgspec.Struct, tag="step_refused", frozen=True, forbid_unknown_fields=True):
    worker_id: str
    incarnation: int
    step_id: int
    state: State
    reason: str
    # The request whose own content the step was refused for (a token id outside the vocabulary): it alone fails,
    # and the worker is not at fault. "": the step as a whole was inconsistent.
    request_id: str = ""


class Proposal(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: str
    num_held: int  # tokens the service holds for the sequence now, its proposal excluded
    token_ids: list[int]  # the proposal, possibly empty (no n-gram match, no draft KV pages free)
    dists: list[SparseDist] | None = None  # sampled proposals: what each token was drawn from
    # A token tree (point masses, no dists): each token's parent among them, always an
    # earlier one, or -1 for the sequence's last token. None: one chain.
    parents: list[int] | None = None
    # Which proposer made it, for the acceptance the scheduler learns per source: "lookup" (prompt
    # lookup), "phrases" (the target's own phrases), "head" (an EAGLE-style head), "model" (a draft
    # model); "" when unsaid.
    source: str = ""
    # Per token, the proposer's own chance that the target accepts it (a tree's node: that its whole
    # branch is accepted); None when unsaid. The scheduler holds it to what the target accepted per
    # source before it sizes a proposal by it.
    chances: list[float] | None = None


class ProposeResult(msgspec.Struct, tag="proposal", frozen=True, forbid_unknown_fields=True):
    worker_id: str
    incarnation: int
    propose_id: int
    proposals: list[Proposal]  # one per ProposeSeq, in request order
    duration_ms: float


class ProposeRefused(msgspec.Struct, tag="propose_refused", frozen=True, forbid_unknown_fields=True):
    worker_id: str
    incarnation: int
    propose_id: int
    state: State
    reason: str


WorkerToScheduler = (
    WorkerHello | LifecycleReport | WorkerFailed | Heartbeat | StepResult | StepRefused | ProposeResult | ProposeRefused
)


T = TypeVar("T")


class Codec(Generic[T]):
    """msgpack encoder plus a strict decoder for one direction's union of messages."""

    def __init__(self, union: object) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(union)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, frame: bytes) -> T:
        """Raises msgspec.DecodeError (or ValidationError) on anything malformed."""
        return self._decoder.decode(frame)
