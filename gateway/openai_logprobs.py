"""Log-probabilities as OpenAI's APIs write them: completions' parallel lists, chat's list of token objects.

Completions: `{"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}],
"text_offset": [...]}`, where each top_logprobs dict holds the asked-for likeliest tokens and
the token itself (OpenAI: "up to logprobs + 1 elements"), and a prompt's first token, which
has no log-probability, has null in both. Chat: `{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}]}]}`. A token is named by its own text
(tokenizer.token_text): part of a character shows as U+FFFD, and its bytes are that text's. A log-probability of
-inf is written as LOGPROB_FLOOR (-9999.0, as vLLM does): JSON has no infinities.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

from proto.messages import TokenLogprob

Scored = tuple[int, TokenLogprob | None]  # a token id and its log-probability (None: a prompt's first token)
# A log-probability of -inf (a token a grammar, a top-k cut or min_tokens ruled out) written as JSON: -Infinity is not
# JSON, and OpenAI's clients read a number there; vLLM writes this one.
LOGPROB_FLOOR = -9999.0


def finite(logprob: float) -> float:
    """The log-probability as a JSON reply writes it: LOGPROB_FLOOR for -inf (and for NaN, which no valid logits
    give)."""
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


class TokenTextSource(Protocol):
    def token_text(self, token_id: int) -> str: ...


class TokenTexts:
    """Each token's text, decoded once."""

    def __init__(self, tokenizer: TokenTextSource) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.token_text(token_id)
        return text


class CompletionLogprobs:
    """Completions' logprobs objects for one choice, chunk by chunk: text_offset runs on across chunks."""

    def __init__(self, texts: TokenTexts) -> None:
        self._texts = texts
        self._offset = 0  # characters of the choice's text so far

    def add(self, entries: Sequence[Scored]) -> dict[str, Any]:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        for token_id, entry in entries:
            text = self._texts(token_id)
            tokens.append(text)
            text_offset.append(self._offset)
            self._offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(finite(entry.logprob))
            top = {self._texts(t.token_id): finite(t.logprob) for t in entry.top}
            top.setdefault(text, finite(entry.logprob))
            top_logprobs.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }

    def skip(self, text: str) -> None:
        """Text of the choice that carries no log-probabilities (an echoed prompt without them)."""
        self._offset += len(text)


def chat_logprobs(entries: Sequence[Scored], texts: TokenTexts) -> dict[str, Any]:
    content = []
    for token_id, entry in entries:
        if entry is None:
            continue
        top = [_chat_token(texts(t.token_id), t.logprob) for t in entry.top]
        content.append({**_chat_token(texts(token_id), entry.logprob), "top_logprobs": top})
    return {"content": content}


def _chat_token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode())}
