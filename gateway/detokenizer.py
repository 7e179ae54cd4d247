"""Incremental detokenization: token ids in, new text out, never a character cut in half."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens decoded as context before the first output token, so that a tokenizer whose
# decode drops the leading space of its first token keeps the space on the first new token.
NUM_CONTEXT_TOKENS = 5

REPLACEMENT_CHARACTER = "\ufffd"  # what decoding writes for incomplete UTF-8


class TokenDecoder(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Two offsets into the ids: text up to `read_offset` has been returned; decoding starts
    at `prefix_offset` (a few tokens earlier) so that word boundaries come out as in a
    full decode. New text is held back while it ends in U+FFFD, since the next token may
    complete that character; `flush()` returns whatever is still held at the end.
    """

    def __init__(self, decoder: TokenDecoder, context_token_ids: Sequence[int] = ()) -> None:
        self._decoder = decoder
        self._token_ids = list(context_token_ids[max(0, len(context_token_ids) - NUM_CONTEXT_TOKENS) :])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """The text that the new ids complete; "" while it would end in an incomplete character."""
        self._token_ids.extend(token_ids)
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHARACTER):
            return ""
        self._advance()
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """The held-back text, incomplete characters decoded as U+FFFD; call once the output has ended."""
        prefix_text, new_text = self._decode_window()
        self._advance()
        return new_text[len(prefix_text) :]

    def _decode_window(self) -> tuple[str, str]:
        window = self._token_ids[self._prefix_offset :]
        returned_ids = window[: self._read_offset - self._prefix_offset]
        return self._decoder.decode(returned_ids), self._decoder.decode(window)

    def _advance(self) -> None:
        # Everything is returned: the returned part becomes the next window's prefix; older ids are dropped.
        del self._token_ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
