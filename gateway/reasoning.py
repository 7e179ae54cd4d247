"""A thinking model's reasoning apart from its answer: `--reasoning-parser`, as vLLM's `reasoning_content`.

Models that think write their reasoning between `<think>` and `</think>`, then the answer.
With a parser named, a chat completion's text is split: the reasoning goes to the message's
`reasoning_content` (streamed: `delta.reasoning_content`), the rest to `content`, the tags to
neither. Two conventions:

- `qwen3`: the model opens the tag itself. An answer that does not start with `<think>` (after
  white space) is all content; one whose tag is never closed is all reasoning.
- `deepseek_r1`: the chat template opens the tag, so the answer starts inside it (a `<think>`
  the model writes anyway is dropped); all of it is reasoning until `</think>`.

Streamed, a piece of text that may be the start of a tag is held back until the next piece
says whether it is one, so no tag is ever sent in part; the end of the answer lets it go.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gateway.output_formats import ReasoningParser

OPEN, CLOSE = "<think>", "</think>"


@dataclass
class Split:
    """Text split so far: reasoning and content, each None until some came."""

    reasoning: str | None = None
    content: str | None = None

    def add(self, reasoning: str, content: str) -> None:
        if reasoning:
            self.reasoning = (self.reasoning or "") + reasoning
        if content:
            self.content = (self.content or "") + content


@dataclass
class ReasoningSplitter:
    """One answer's text, piece by piece, into (reasoning, content) pieces."""

    parser: ReasoningParser
    _state: Literal["start", "inside", "after"] = field(init=False)
    _held: str = field(default="", init=False)  # text that may be the start of a tag

    def __post_init__(self) -> None:
        self._state = "start"

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content this piece of text gives (either may be "")."""
        text = self._held + text
        self._held = ""
        reasoning, content = "", ""
        while text:
            if self._state == "start":
                stripped = text.lstrip()
                if stripped.startswith(OPEN):
                    self._state = "inside"
                    text = stripped[len(OPEN) :]
                elif OPEN.startswith(stripped):  # white space, or the tag begun: wait for more
                    self._held = text
                    return reasoning, content
                else:
                    self._state = "inside" if self.parser == "deepseek_r1" else "after"
            elif self._state == "inside":
                at = text.find(CLOSE)
                if at >= 0:
                    reasoning += text[:at]
                    text = text[at + len(CLOSE) :]
                    self._state = "after"
                    continue
                keep = partial_suffix(text, CLOSE)
                reasoning += text[: len(text) - keep]
                self._held = text[len(text) - keep :]
                return reasoning, content
            else:
                content += text
                text = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the answer has ended: not a tag after all."""
        held, self._held = self._held, ""
        if self._state == "inside" or (self._state == "start" and self.parser == "deepseek_r1"):
            return held, ""
        return "", held


def split_whole(parser: ReasoningParser, text: str) -> Split:
    """A whole answer's reasoning and content."""
    splitter = ReasoningSplitter(parser)
    split = Split()
    split.add(*splitter.feed(text))
    split.add(*splitter.finish())
    return split


def partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of `text` are the start of `tag` (0 if none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
