"""What the core sends during one event, in order: messages to workers and gateways, token deltas batched per gateway.

Each frame keeps to what its receiver takes (proto/frames.py): more deltas, a longer chunk's prompt log-probabilities
and more released ids go in several frames, and an error's text is cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import msgspec

from proto import messages as m
from scheduler.requests import Request


@dataclass(frozen=True)
class Outgoing:
    to_worker: bool  # False: to a gateway
    identity: bytes
    message: msgspec.Struct


class Outbox:
    """The messages collected so far; the shell takes and sends them after every event."""

    def __init__(self) -> None:
        self._messages: list[Outgoing] = []
        self._pending_deltas: dict[bytes, list[m.TokenDelta]] = {}  # per gateway, sent as one frame per event

    def take(self) -> list[Outgoing]:
        """Everything collected so far, in order (deltas still pending stay for the end of the event)."""
        messages, self._messages = self._messages, []
        return messages

    def to_worker(self, identity: bytes, message: msgspec.Struct) -> None:
        if isinstance(message, m.ReleaseSequences):
            for ids in _chunks(message.request_ids, m.MAX_RELEASE_IDS):
                self._messages.append(Outgoing(True, identity, m.ReleaseSequences(message.incarnation, ids)))
            return
        self._messages.append(Outgoing(True, identity, message))

    def to_gateway(self, identity: bytes, message: msgspec.Struct) -> None:
        """Any other message to a gateway goes after the deltas already pending for it."""
        self.flush_deltas(identity)
        if isinstance(message, m.RequestError):  # it may quote a worker's failure
            message = msgspec.structs.replace(message, message=message.message[: m.MAX_REASON_CHARS])
        self._messages.append(Outgoing(False, identity, message))

    def emit(
        self,
        request: Request,
        token_ids: list[int],
        finish_reason: m.FinishReason | None,
        *,
        logprobs: list[m.TokenLogprob] | None = None,
        prompt_logprobs: list[m.TokenLogprob] | None = None,
    ) -> None:
        """New tokens (or the finish, or prompt log-probabilities) of a request, for its gateway, sent with the others
        at the end of the event."""
        if not token_ids and finish_reason is None and not prompt_logprobs:
            return
        scored = _chunks(prompt_logprobs or [], m.MAX_PROMPT_LOGPROBS_PER_DELTA)
        for entries in scored[:-1]:  # a long chunk's leading prompt log-probabilities, in deltas of their own
            self._delta(request, [], None, None, entries)
        self._delta(request, token_ids, finish_reason, logprobs if token_ids else None, scored[-1] if scored else None)

    def _delta(
        self,
        request: Request,
        token_ids: list[int],
        finish_reason: m.FinishReason | None,
        logprobs: list[m.TokenLogprob] | None,
        prompt_logprobs: list[m.TokenLogprob] | None,
    ) -> None:
        self._pending_deltas.setdefault(request.gateway, []).append(
            m.TokenDelta(
                request_id=request.request_id,
                token_ids=token_ids,
                finish_reason=finish_reason,
                num_prompt_tokens=len(request.prompt_token_ids),
                num_completion_tokens=len(request.output_token_ids),
                num_draft_tokens=request.num_draft_tokens,
                num_accepted_draft_tokens=request.num_accepted_draft_tokens,
                num_verify_steps=request.num_verify_steps,
                num_cached_tokens=request.num_cached_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        )

    def flush_deltas(self, only: bytes | None = None) -> None:
        for gateway in [only] if only is not None else list(self._pending_deltas):
            for deltas in _chunks(self._pending_deltas.pop(gateway, []), m.MAX_DELTAS_PER_FRAME):
                self._messages.append(Outgoing(False, gateway, m.TokenDeltas(deltas)))


T = TypeVar("T")


def _chunks(items: list[T], size: int) -> list[list[T]]:
    """`items` in order, in lists of `size` at most (none for none)."""
    return [items[start : start + size] for start in range(0, len(items), size)]
