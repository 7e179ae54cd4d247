"""One request's output: the scheduler's token deltas in, client chunks (text, token ids, finish, usage) out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.detokenizer import IncrementalDetokenizer, TokenDecoder
from gateway.stop_strings import StopStringMatcher
from proto import messages


@dataclass(frozen=True)
class Chunk:
    text: str  # new text since the previous chunk
    token_ids: list[int]  # new tokens since the previous chunk
    finish_reason: messages.FinishReason | None  # set on the last chunk only
    stop_string: str | None  # the stop string that ended the output, if one did
    num_prompt_tokens: int
    num_completion_tokens: int  # tokens sent in all chunks so far, these included
    speculation: SpecUsage  # the request's speculation so far, as the scheduler last reported it
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held, as the scheduler last reported it
    logprobs: list[messages.TokenLogprob] | None = None  # when asked: one per token id
    # When asked: the next prompt tokens with their log-probabilities; the first chunk's starts with the prompt's
    # first token, which has none.
    prompt_logprobs: list[tuple[int, messages.TokenLogprob | None]] | None = None


@dataclass(frozen=True)
class SpecUsage:
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_verify_steps: int = 0


class RequestOutput:
    """Detokenizes token by token and cuts at the first stop string.

    When a stop string completes inside a delta, the tokens after the one that completed
    it are dropped and the output finishes with reason "stop"; the caller then aborts the
    request in the scheduler. Calling `add` after the output finished raises.
    """

    def __init__(self, decoder: TokenDecoder, prompt_token_ids: Sequence[int], stop_strings: Sequence[str]) -> None:
        self._detokenizer = IncrementalDetokenizer(decoder, prompt_token_ids)
        self._matcher = StopStringMatcher(stop_strings)
        self._num_prompt_tokens = len(prompt_token_ids)
        self._prompt_token_ids = prompt_token_ids
        self._num_prompt_scored = 1  # the first prompt token has no log-probability
        self._num_completion_tokens = 0
        self._finish_reason: messages.FinishReason | None = None
        self._speculation = SpecUsage()
        self._num_cached_tokens = 0

    @property
    def finish_reason(self) -> messages.FinishReason | None:
        return self._finish_reason

    def add(
        self,
        token_ids: Sequence[int],
        finish_reason: messages.FinishReason | None,
        speculation: SpecUsage | None = None,
        num_cached_tokens: int | None = None,
        *,
        logprobs: Sequence[messages.TokenLogprob] | None = None,
        prompt_logprobs: Sequence[messages.TokenLogprob] | None = None,
    ) -> Chunk:
        """The chunk for one delta; finish_reason is the scheduler's (None: more deltas follow). `logprobs` go with
        token_ids (cut where they are); `prompt_logprobs` pass through."""
        if self._finish_reason is not None:
            raise RuntimeError(f"RequestOutput.add after the output finished ({self._finish_reason})")
        if speculation is not None:
            self._speculation = speculation
        if num_cached_tokens is not None:
            self._num_cached_tokens = num_cached_tokens
        text_parts: list[str] = []
        sent_ids: list[int] = []
        for token_id in token_ids:
            sent_ids.append(token_id)
            text_parts.append(self._feed(self._detokenizer.add([token_id])))
            if self._matcher.matched is not None:
                break
        if self._matcher.matched is None and finish_reason is not None:
            text_parts.append(self._feed(self._detokenizer.flush()))
            if self._matcher.matched is None:
                text_parts.append(self._matcher.flush())
        scored: list[tuple[int, messages.TokenLogprob | None]] | None = None
        if prompt_logprobs:
            first = self._num_prompt_scored
            scored = [(self._prompt_token_ids[0], None)] if first == 1 else []
            scored += zip(self._prompt_token_ids[first : first + len(prompt_logprobs)], prompt_logprobs, strict=True)
            self._num_prompt_scored += len(prompt_logprobs)
        return self._chunk(
            "".join(text_parts),
            sent_ids,
            finish_reason,
            None if logprobs is None else list(logprobs[: len(sent_ids)]),
            scored,
        )

    def _feed(self, text: str) -> str:
        return self._matcher.feed(text).text if text else ""

    def _chunk(
        self,
        text: str,
        token_ids: list[int],
        finish_reason: messages.FinishReason | None,
        logprobs: list[messages.TokenLogprob] | None,
        prompt_logprobs: list[tuple[int, messages.TokenLogprob | None]] | None,
    ) -> Chunk:
        self._num_completion_tokens += len(token_ids)
        if self._matcher.matched is not None:
            finish_reason = "stop"
        self._finish_reason = finish_reason
        return Chunk(
            text=text,
            token_ids=token_ids,
            finish_reason=finish_reason,
            stop_string=self._matcher.matched,
            num_prompt_tokens=self._num_prompt_tokens,
            num_completion_tokens=self._num_completion_tokens,
            speculation=self._speculation,
            num_cached_tokens=self._num_cached_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
