"""One generation request as the scheduler holds it, with its lifecycle of statuses."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from proto.messages import FinishReason, SamplingParams
from scheduler.features import FeatureStore


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # in the queue, no worker yet
    RUNNING = "running"  # placed on a worker, holds a KV slot there
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FAILED = "failed"


FINISHED: frozenset[RequestStatus] = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED, RequestStatus.FAILED}
)

FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class DraftView:
    """What the draft service holds for a request: `num_stable` of its tokens, then its last proposal.

    The next propose request drops the `num_proposed` tokens that are not (yet) part of
    the sequence and appends the sequence from `num_stable` on.
    """

    num_stable: int = 0
    num_proposed: int = 0
    num_features: int = 0  # target feature rows it holds (positions 0 .. num_features-1), for a draft that reads them
    known: bool = False  # the draft service was ever told about it (so it must be told to forget it)
    generation: int = 0  # bumped by reset(): a verify result for an older generation must not move the counts

    @property
    def num_held(self) -> int:
        return self.num_stable + self.num_proposed

    def accept(self, num_accepted: int) -> None:
        """The first num_accepted proposed tokens became part of the sequence."""
        self.num_stable += num_accepted
        self.num_proposed -= num_accepted

    def reset(self) -> None:
        """The draft service's state is unknown (timeout) or gone (new incarnation)."""
        self.num_stable = self.num_proposed = self.num_features = 0
        self.generation += 1


@dataclass
class Request:
    request_id: str
    gateway: bytes  # routing identity of the gateway that streams this request
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    waiting_since_s: float  # monotonic time it (last) entered the queue
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    worker_id: str | None = None
    slot: int | None = None
    num_computed_tokens: int = 0  # tokens whose keys and values the worker's slot holds
    draft: DraftView = field(default_factory=lambda: DraftView())
    features: FeatureStore = field(default_factory=FeatureStore, compare=False, repr=False)  # while a draft reads features
    # Speculation so far: draft tokens verified, accepted, and verify steps.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_verify_steps: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens start..stop-1 of prompt-then-output."""
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        return (self.prompt_token_ids + self.output_token_ids)[start:stop]

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED

    def finish_status_after_append(self, max_model_len: int) -> RequestStatus | None:
        """The status a just-extended request finishes with, or None to keep generating."""
        if self.output_token_ids and self.output_token_ids[-1] in self.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
