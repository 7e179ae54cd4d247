"""Stop strings: find them in streamed text, even across chunks, and cut the text where the first begins."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopCheck:
    text: str  # safe to send: it holds no stop string and cannot be the start of one
    matched: str | None  # the stop string found; the output ends right before it


class StopStringMatcher:
    """Holds back the longest tail of the text that is the start of some stop string.

    Nothing else is held, and a stop string is always seen whole before any of its
    characters is sent. Once one has matched, the text has ended.
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self._stop_strings = tuple(stop_strings)
        self._held = ""
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        return self._matched

    def feed(self, text: str) -> StopCheck:
        if self._matched is not None:
            raise RuntimeError("StopStringMatcher.feed after a stop string matched: the text has ended")
        pending = self._held + text
        match = earliest_match(pending, self._stop_strings)
        # The earliest place a stop string may still begin and complete with more text.
        hold_from = len(pending) - partial_match_length(pending, self._stop_strings)
        if match is not None and match[0] <= hold_from:
            start, self._matched = match
            self._held = ""
            return StopCheck(pending[:start], self._matched)
        # No match yet, or one that a longer stop string starting earlier may still beat.
        self._held = pending[hold_from:]
        return StopCheck(pending[:hold_from], None)

    def flush(self) -> str:
        """The held text once the text has ended: cut at a stop string it holds (then `matched` is set)."""
        held, self._held = self._held, ""
        match = earliest_match(held, self._stop_strings)
        if match is None:
            return held
        start, self._matched = match
        return held[:start]


def earliest_match(text: str, stop_strings: Sequence[str]) -> tuple[int, str] | None:
    """(start, stop string) of the occurrence that starts first, or None."""
    found = [(start, stop) for stop in stop_strings if (start := text.find(stop)) >= 0]
    return min(found, key=lambda hit: hit[0], default=None)


def partial_match_length(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest tail of text that is a proper prefix of some stop string."""
    longest = 0
    for stop in stop_strings:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
