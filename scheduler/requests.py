"""Generation requests as the scheduler holds them: admission, the waiting queue, and each request's status moves."""

from __future__ import annotations

import bisect
import enum
import math
import random
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import msgspec

from proto import messages as m


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # in the queue, no worker yet
    RUNNING = "running"  # placed on a worker, holds KV pages there
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FAILED = "failed"


_S = RequestStatus
# Every status a request may move to from each status. A running request goes back to
# WAITING when its worker is lost or it is preempted for pages. A waiting one fails (no READY
# worker in time, a prompt no worker's KV cache can hold), and a running one when a worker
# refuses it for its content or it was in flight on too many lost workers.
REQUEST_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    _S.WAITING: frozenset({_S.RUNNING, _S.FINISHED_ABORTED, _S.FAILED}),
    _S.RUNNING: frozenset({_S.WAITING, _S.FINISHED_STOPPED, _S.FINISHED_LENGTH, _S.FINISHED_ABORTED, _S.FAILED}),
    _S.FINISHED_STOPPED: frozenset(),
    _S.FINISHED_LENGTH: frozenset(),
    _S.FINISHED_ABORTED: frozenset(),
    _S.FAILED: frozenset(),
}

FINISH_REASONS: dict[RequestStatus, m.FinishReason] = {
    _S.FINISHED_STOPPED: "stop",
    _S.FINISHED_LENGTH: "length",
    _S.FINISHED_ABORTED: "abort",
}


class IllegalRequestMove(RuntimeError):
    """A status move the table does not allow: a bug in the scheduler, never input."""


# The protocol's limits (proto/messages.py), which size the gateway socket's frames (proto/frames.py).
MAX_REQUEST_ID_CHARS = m.MAX_REQUEST_ID_CHARS
MAX_STOP_TOKEN_IDS = m.MAX_STOP_TOKEN_IDS
MAX_GRAMMAR_CHARS = m.MAX_GRAMMAR_CHARS
MAX_CACHE_SALT_CHARS = m.MAX_CACHE_SALT_CHARS


def sampling_problem(sampling: m.SamplingParams) -> str:
    """Why these sampling values cannot be served ("" when they can)."""
    if not math.isfinite(sampling.temperature) or not 0.0 <= sampling.temperature <= m.MAX_TEMPERATURE:
        return f"temperature {sampling.temperature} is outside 0 .. {m.MAX_TEMPERATURE:g}"
    if not (math.isfinite(sampling.top_p) and 0.0 < sampling.top_p <= 1.0):
        return f"top_p {sampling.top_p} is outside (0, 1]"
    if sampling.top_k < 0:
        return f"top_k {sampling.top_k} is negative"
    if not 0.0 <= sampling.min_p <= 1.0:  # also false for NaN
        return f"min_p {sampling.min_p} is outside [0, 1]"
    if not 0 <= sampling.seed < 1 << 64:
        return f"seed {sampling.seed} is outside 0 .. 2^64 - 1"
    return penalties_problem(sampling.penalties) if sampling.penalties is not None else ""


def penalties_problem(penalties: m.Penalties) -> str:
    """Why these penalties cannot be served ("" when they can); token ids are checked with the prompt's."""
    for name, value in (("presence_penalty", penalties.presence), ("frequency_penalty", penalties.frequency)):
        if not (math.isfinite(value) and -m.MAX_PENALTY <= value <= m.MAX_PENALTY):
            return f"{name} {value} is outside -{m.MAX_PENALTY} .. {m.MAX_PENALTY}"
    if not (math.isfinite(penalties.repetition)
            and m.MIN_REPETITION_PENALTY <= penalties.repetition <= m.MAX_REPETITION_PENALTY):
        return (f"repetition_penalty {penalties.repetition} is outside "
                f"{m.MIN_REPETITION_PENALTY} .. {m.MAX_REPETITION_PENALTY}")
    if len(penalties.logit_bias) > m.MAX_LOGIT_BIAS_ENTRIES:
        return f"logit_bias has {len(penalties.logit_bias)} entries, at most {m.MAX_LOGIT_BIAS_ENTRIES}"
    for token, bias in penalties.logit_bias.items():
        if not (math.isfinite(bias) and -m.MAX_LOGIT_BIAS <= bias <= m.MAX_LOGIT_BIAS):
            return f"logit_bias of token {token} is {bias}, outside -{m.MAX_LOGIT_BIAS} .. {m.MAX_LOGIT_BIAS}"
    if penalties.min_tokens < 0:
        return f"min_tokens {penalties.min_tokens} is negative"
    if len(penalties.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        return f"the penalties' stop_token_ids has more than {MAX_STOP_TOKEN_IDS} ids"
    return ""


def token_problem(submit: m.SubmitRequest | Request, vocab_size: int) -> str:
    """A prompt or stop token id outside the vocabulary of `vocab_size` ids (any negative one when it is not known)."""
    penalties = submit.sampling.penalties or m.Penalties()
    for field_name, ids in (("prompt_token_ids", list(submit.prompt_token_ids)), ("stop_token_ids", list(submit.stop_token_ids)),
                            ("logit_bias", list(penalties.logit_bias)), ("min_tokens' stop_token_ids", penalties.stop_token_ids)):
        if ids and (min(ids) < 0 or (vocab_size and max(ids) >= vocab_size)):
            bad = next(i for i in ids if i < 0 or (vocab_size and i >= vocab_size))
            return f"{field_name} holds {bad}, outside the vocabulary of {vocab_size or 'the model'} ids"
    return ""


class RequestRejected(Exception):
    def __init__(self, code: m.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Request:
    request_id: str
    gateway: bytes  # routing identity of the gateway that streams this request
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: m.SamplingParams
    stop_token_ids: frozenset[int]
    waiting_since_s: float  # monotonic time it (last) entered the queue
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING  # moved only by move_to
    worker_id: str | None = None
    num_computed_tokens: int = 0  # tokens whose keys and values its pages on the worker hold
    num_cached_tokens: int = 0  # prompt tokens its first placement found in the prefix cache (for usage)
    num_preemptions: int = 0
    # Workers lost with a step of this request in flight; from two on it is a suspect and runs in steps of its own
    # until it ends (SchedulerCore._quarantine, --max-request-retries).
    num_lost_steps: int = 0
    suspect: bool = False
    # Speculation so far: draft tokens verified, accepted, and verify steps.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_verify_steps: int = 0
    # Log-probabilities asked for (-1: none; n: with n alternatives), and the next prompt position whose is still owed.
    num_logprobs: int = -1
    num_prompt_logprobs: int = -1
    prompt_logprobs_done: int = 1  # the first prompt token has none
    num_resumed_tokens: int = 0  # completion tokens at the end of prompt_token_ids (a request resumed from another)
    grammar: str | None = None  # what its completion follows (the worker masks every row by it)
    cache_salt: str = ""  # its prefix-cache pages are shared only under this salt
    priority: int = 0  # under --scheduling-policy priority: lower is placed first and preempted last
    arrival: int = 0  # its place in the order requests were admitted (earlier first among equal priorities)
    forced_token_ids: list[int] = field(default_factory=list)  # what its grammar forces next: the next step's drafts

    @property
    def num_own_prompt_tokens(self) -> int:
        """The prompt as the client sent it, without the completion tokens a resumed request carries in it."""
        return len(self.prompt_token_ids) - self.num_resumed_tokens

    @property
    def scores_prompt(self) -> bool:
        """Prompt log-probabilities are owed: its prompt is computed, not taken from the prefix cache."""
        return self.num_prompt_logprobs >= 0 and self.prompt_logprobs_done < len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt, then output."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens start..stop-1 of prompt-then-output."""
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        return (self.prompt_token_ids + self.output_token_ids)[start:stop]

    def move_to(self, status: RequestStatus) -> None:
        if status not in REQUEST_TRANSITIONS[self.status]:
            raise IllegalRequestMove(f"request {self.request_id}: {self.status.value} -> {status.value}")
        self.status = status

    def finish_status_after_append(self, max_model_len: int) -> RequestStatus | None:
        """The status a just-extended request finishes with, or None to keep generating."""
        if self.output_token_ids and self.output_token_ids[-1] in self.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def _queue_key(request: Request) -> tuple[int, int]:
    """Where a request stands under --scheduling-policy priority: lower priority values first, then earlier arrivals."""
    return request.priority, request.arrival


class RequestTable:
    """Every unfinished request by id, and the waiting ones in the order they will be placed."""

    def __init__(self, max_model_len: int, max_queue_len: int, rng: random.Random, *, by_priority: bool = False) -> None:
        self._max_model_len = max_model_len
        self._max_queue_len = max_queue_len
        self._rng = rng
        self._by_priority = by_priority  # --scheduling-policy priority: the queue in (priority, arrival) order
        self._by_id: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._num_admitted = 0

    def get(self, request_id: str) -> Request | None:
        return self._by_id.get(request_id)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._by_id.values())

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._by_id) - len(self._waiting)

    @property
    def waiting(self) -> list[Request]:
        return list(self._waiting)

    def admit(self, gateway: bytes, submit: m.SubmitRequest, now_s: float, *, vocab_size: int = 0) -> Request:
        """Queue a submitted request; raises RequestRejected, changing nothing, when it cannot be served.

        Everything is checked, whoever sent it: token ids against the targets' vocabulary
        (`vocab_size`, 0 while no target has said hello: then when the first one does),
        sampling values, sizes.
        """
        limit = self._max_model_len
        num_prompt = len(submit.prompt_token_ids)
        if not 0 < len(submit.request_id) <= MAX_REQUEST_ID_CHARS:
            raise RequestRejected("INVALID_ARGUMENT", f"request_id must have 1 to {MAX_REQUEST_ID_CHARS} characters")
        if submit.request_id in self._by_id:
            raise RequestRejected("INVALID_ARGUMENT", f"request_id {submit.request_id!r} is already in use")
        if problem := sampling_problem(submit.sampling) or token_problem(submit, vocab_size):
            raise RequestRejected("INVALID_ARGUMENT", problem)
        if submit.grammar is not None and not 0 < len(submit.grammar) <= MAX_GRAMMAR_CHARS:
            raise RequestRejected("INVALID_ARGUMENT", f"grammar must have 1 to {MAX_GRAMMAR_CHARS} characters")
        if len(submit.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise RequestRejected("INVALID_ARGUMENT", f"cache_salt has more than {MAX_CACHE_SALT_CHARS} characters")
        if len(submit.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestRejected("INVALID_ARGUMENT", f"stop_token_ids has more than {MAX_STOP_TOKEN_IDS} ids")
        if num_prompt == 0:
            raise RequestRejected("INVALID_ARGUMENT", "prompt_token_ids is empty")
        if not 0 <= submit.resumed_tokens < num_prompt:
            raise RequestRejected("INVALID_ARGUMENT", f"resumed_tokens {submit.resumed_tokens} is not less than the "
                                                      f"{num_prompt} tokens of prompt_token_ids")
        for name, count in (("logprobs", submit.logprobs), ("prompt_logprobs", submit.prompt_logprobs)):
            if count is not None and not 0 <= count <= m.MAX_TOP_LOGPROBS:
                raise RequestRejected("INVALID_ARGUMENT", f"{name} must be 0 to {m.MAX_TOP_LOGPROBS}, got {count}")
        least = 0 if submit.prompt_logprobs is not None else 1  # scoring a prompt alone generates nothing
        if submit.max_tokens is not None and submit.max_tokens < least:
            raise RequestRejected("INVALID_ARGUMENT", f"max_tokens must be at least {least}, got {submit.max_tokens}")
        max_tokens = submit.max_tokens if submit.max_tokens is not None else limit - num_prompt
        if num_prompt + max(max_tokens, 1) > limit:
            raise RequestRejected(
                "INVALID_ARGUMENT",
                f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) exceeds the context of {limit} tokens",
            )
        if submit.priority and not self._by_priority:
            raise RequestRejected("INVALID_ARGUMENT", f"priority {submit.priority}: this scheduler serves requests in "
                                                      "the order they come (--scheduling-policy fcfs); only 0 is taken")
        if not m.MIN_PRIORITY <= submit.priority <= m.MAX_PRIORITY:
            raise RequestRejected("INVALID_ARGUMENT", f"priority must be in [{m.MIN_PRIORITY}, {m.MAX_PRIORITY}], "
                                                      f"got {submit.priority}")
        if len(self._waiting) >= self._max_queue_len:
            raise RequestRejected("RESOURCE_EXHAUSTED", f"the queue is full ({self._max_queue_len} waiting requests)")
        sampling = submit.sampling
        if not submit.seed_given:
            sampling = msgspec.structs.replace(sampling, seed=self._rng.getrandbits(63))
        request = Request(
            request_id=submit.request_id, gateway=gateway, prompt_token_ids=list(submit.prompt_token_ids),
            max_tokens=max_tokens, sampling=sampling, stop_token_ids=frozenset(submit.stop_token_ids),
            waiting_since_s=now_s, num_logprobs=-1 if submit.logprobs is None else submit.logprobs,
            num_prompt_logprobs=-1 if submit.prompt_logprobs is None else submit.prompt_logprobs,
            num_resumed_tokens=submit.resumed_tokens, grammar=submit.grammar, cache_salt=submit.cache_salt,
            priority=submit.priority, arrival=self._num_admitted,
        )
        self._num_admitted += 1
        self._by_id[request.request_id] = request
        self._enqueue(request, front=False)
        return request

    def _enqueue(self, request: Request, *, front: bool) -> None:
        """Into the queue: in (priority, arrival) order by priority; else at the back, or the front (`front`)."""
        if self._by_priority:
            index = bisect.bisect_right(self._waiting, _queue_key(request), key=_queue_key)
            self._waiting.insert(index, request)
        elif front:
            self._waiting.appendleft(request)
        else:
            self._waiting.append(request)

    def preemption_order(self, running: Iterable[Request]) -> list[Request]:
        """Running requests in the order a worker out of pages preempts them: the last placed first; by priority, the
        lowest priority (largest value) first, the latest admitted first among equals."""
        ordered = list(running)[::-1]
        if self._by_priority:
            ordered.sort(key=_queue_key, reverse=True)
        return ordered

    def first_waiting(self) -> Request | None:
        return self._waiting[0] if self._waiting else None

    def start(self, request: Request, worker_id: str, num_cached_tokens: int) -> None:
        """The first waiting request now runs on that worker, its first `num_cached_tokens` tokens' keys and values
        found in the prefix cache."""
        assert self._waiting[0] is request
        self._waiting.popleft()
        request.move_to(RequestStatus.RUNNING)
        request.worker_id = worker_id
        request.num_computed_tokens = num_cached_tokens
        if not request.output_token_ids and not request.num_preemptions:  # its first placement: what usage reports
            request.num_cached_tokens = min(num_cached_tokens, len(request.prompt_token_ids))

    def requeue(self, requests: list[Request], now_s: float) -> None:
        """Running requests whose worker was lost (or that were preempted) go back to the front of the queue, in
        their order (by priority: to the front of their priority's requests, among which they came first).

        Each is recomputed from its prompt and the tokens already streamed.
        """
        for request in reversed(requests):
            request.move_to(RequestStatus.WAITING)
            request.worker_id = None
            request.num_computed_tokens = 0
            request.waiting_since_s = now_s
            self._enqueue(request, front=True)  # by priority: before every later arrival of its priority

    def finish(self, request: Request, status: RequestStatus) -> None:
        """The request leaves the table (and the queue); its worker's pages are the caller's to free."""
        if request.status is RequestStatus.WAITING:
            self._waiting.remove(request)
        request.move_to(status)
        del self._by_id[request.request_id]
