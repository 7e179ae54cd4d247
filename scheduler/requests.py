"""A generation request as the scheduler holds it: its tokens, what it asked for, and its status, moved only along
the one table of legal status moves (REQUEST_TRANSITIONS)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

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
    # until it ends (endings.py, --max-request-retries).
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
    tenant: str = ""  # whose text a draft that learns from traffic drafts from for it, and whose its text becomes
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
