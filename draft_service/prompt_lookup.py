"""Prompt lookup: proposals found in the sequence's own tokens, a point mass each (`--draft ngram`)."""

from __future__ import annotations

from collections.abc import Callable

from draft_service.proposer import ProposeInput, Proposed, StatelessProposer, nothing


class LookupProposer(StatelessProposer):
    """A stateless proposer whose proposal is one lookup over the sequence's tokens (a point mass)."""

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def find(self, tokens: list[int], k: int) -> Proposed:
        """The lookup's chain, named by its source."""
        return Proposed(self.lookup(tokens, k), source="lookup")

    def propose(self, batch: list[ProposeInput]) -> list[Proposed]:
        return [self.find(item.token_ids, item.num_tokens) for item in batch]


class NgramProposer(LookupProposer):
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self._ngram_min = ngram_min
        self._ngram_max = ngram_max

    def phases(self) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
        return nothing, nothing, self.self_check

    def self_check(self) -> None:
        sequence = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
        proposal = self.lookup(sequence, 3)
        if proposal != [8, 9, 1]:
            raise RuntimeError(f"n-gram self-check: expected [8, 9, 1], got {proposal}")

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The k tokens after the latest earlier occurrence of the last n tokens, trying the longest n first."""
        length = len(tokens)
        for n in range(min(self._ngram_max, length - 1), self._ngram_min - 1, -1):
            pattern = tokens[length - n :]
            last = pattern[-1]
            # Candidate ends of an earlier occurrence, latest first: positions < length - 1 holding `last`.
            end = length - 2
            while end >= n - 1:
                if tokens[end] == last and tokens[end - n + 1 : end + 1] == pattern:
                    return tokens[end + 1 : end + 1 + k]
                end -= 1
        return []
