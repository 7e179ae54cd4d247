"""The target's own phrases: a store of sequences it answered, which drafts continue where the text is formulaic.

A small instruct model says the same things in the same words across requests ("Here's
a Python function that", "I hope this helps!"). `specserve distill` keeps the sequences
the target answered for its training data (chat template, request and the target's
answer) in the draft folder (`phrases.safetensors`); the draft service finds where the
sequence's last tokens (1 to 8 of them, the longest that match) occur in them and
proposes what followed most often: up to k tokens after a match of 3 or more, at most as
many as it matched after a shorter one (`continue_`), or, for a token tree, what followed
at all, each branch with the chance that the target writes it (`guesses`). Like prompt
lookup it costs no model step, and verification keeps the output exact whatever it
proposes.

Index: every position c that follows a token, sorted by the tokens before it read
backwards (c-1, c-2, ... up to MAX_CONTEXT, stopping at a sequence boundary). The
positions whose context ends with the sequence's last n tokens then form one range of
that order, and each further token of context narrows the range by a binary search.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

FILE_NAME = "phrases.safetensors"
MAX_CONTEXT = 8  # the longest context matched
MIN_CONTEXT = 1  # the shortest match that proposes anything (unless the caller asks for more)
# From this many tokens matched on, a proposal may be k tokens long; a shorter match of n
# tokens proposes at most n. Its guesses are right less often (on chat the first token of
# a 2-token match 21% of the time, of a 6-token one 56%), but one or two draft tokens cost
# the verify step little, and without them most chat steps guess nothing at all
# (docs/benchmarks.md).
FULL_CONTEXT = 3
MAX_OCCURRENCES = 64  # continuations a proposal is voted from, spread evenly over all the occurrences
# For a token tree (`guesses`): how often a guess is the target's next token, per share of
# the continuations that agree with it, by the length of the match it continues (the
# match plus the guesses before it on its branch). Measured on the tuning requests
# (bench/spec_prompts.py TUNING), never on a benchmark workload: a token that follows 80-100%
# of a 4-token match's occurrences was right 68% of the time, 20-40% of them 14%.
TRUST_BY_MATCH = (0.0, 0.5, 0.5, 0.57, 0.7, 0.7, 0.7, 0.78, 0.95)  # index: tokens matched, 1 .. MAX_CONTEXT
GUESS_MATCHES = 2  # a tree's guesses come from the longest match and the one a token shorter
MIN_CHANCE = 0.02  # by default a guess less likely than this is left out of a tree (it would rarely pay for its row)
_BOUNDARY = -1  # between sequences; never a token


class PhraseError(ValueError):
    """A phrase file that does not fit the target it is served for."""


class PhraseStore:
    """Token sequences and the index above; `continue_` proposes from them."""

    def __init__(self, tokens: np.ndarray) -> None:
        # tokens: [N] int64, the sequences one after another, each preceded by _BOUNDARY; MAX_CONTEXT boundaries end it
        self._tokens = tokens
        after = (
            np.flatnonzero((tokens[:-1] != _BOUNDARY) & (tokens[1:] != _BOUNDARY)) + 1
        )  # positions that follow a token
        columns = [tokens[after - 1]]  # column d: the token d + 1 places back, or _BOUNDARY past the sequence's start
        for depth in range(1, MAX_CONTEXT):
            back = tokens[np.maximum(after - 1 - depth, 0)]
            columns.append(np.where(columns[-1] == _BOUNDARY, _BOUNDARY, back))
        order = np.lexsort(columns[::-1])  # the last key sorts first: the token right before the position
        self._positions = after[order]  # [M]
        self._last = columns[0][order]  # [M]: the token before each sorted position
        self._second = columns[1][order]  # [M]: the one before that

    @classmethod
    def from_sequences(cls, sequences: list[list[int]]) -> PhraseStore:
        parts: list[int] = []
        for seq in sequences:
            parts.append(_BOUNDARY)
            parts.extend(seq)
        parts.extend([_BOUNDARY] * MAX_CONTEXT)  # a continuation read past the end meets a boundary
        return cls(np.asarray(parts, dtype=np.int64))

    @classmethod
    def load(cls, folder: Path, vocab_size: int) -> PhraseStore | None:
        """The folder's phrases, or None when it has none; ids outside the vocabulary are refused."""
        path = folder / FILE_NAME
        if not path.exists():
            return None
        tensors = load_file(path)
        if "tokens" not in tensors:
            raise PhraseError(f"{path} has no 'tokens' tensor")
        tokens = tensors["tokens"].astype(np.int64)
        if tokens.ndim != 1 or tokens.size < 2 or tokens[0] != _BOUNDARY or tokens[-1] != _BOUNDARY:
            raise PhraseError(f"{path}: 'tokens' must be one row that starts and ends with a boundary ({_BOUNDARY})")
        outside = tokens[(tokens != _BOUNDARY) & ((tokens < 0) | (tokens >= vocab_size))]
        if outside.size:
            raise PhraseError(
                f"{path} holds token id {int(outside[0])}, outside the target's vocabulary of {vocab_size}"
            )
        return cls(tokens)

    def save(self, folder: Path) -> None:
        tmp = folder / (FILE_NAME + ".tmp")
        save_file({"tokens": self._tokens.astype(np.int32)}, str(tmp))
        tmp.replace(folder / FILE_NAME)

    @property
    def num_tokens(self) -> int:
        return int((self._tokens != _BOUNDARY).sum())

    def continue_(self, context: list[int], k: int, min_context: int = MIN_CONTEXT) -> list[int]:
        """Up to k tokens that most often followed the longest match (at least min_context tokens) of the context's end;
        a match shorter than FULL_CONTEXT proposes at most as many tokens as it matched."""
        if k < 1:
            return []
        matches = self._matches(context, min_context)
        if not matches:
            return []
        lo, hi, matched = matches[-1]
        if matched < FULL_CONTEXT:
            k = min(k, matched)
        continuations = self._continuations(lo, hi, k)
        proposal: list[int] = []
        for step in range(k):
            column = continuations[:, step]
            column = column[column != _BOUNDARY]
            if column.size == 0:
                break
            values, counts = np.unique(column, return_counts=True)
            token = int(values[counts.argmax()])  # the most frequent; the lowest id among equals
            proposal.append(token)
            continuations = continuations[continuations[:, step] == token]
        return proposal

    def guesses(
        self, context: list[int], k: int, min_context: int = MIN_CONTEXT, min_chance: float = MIN_CHANCE
    ) -> dict[tuple[int, ...], float]:
        """Continuations of up to k tokens of the context's end, each with the chance that the target writes it next:
        for every branch of what followed the longest match (and the match a token shorter; at least min_context
        tokens; a match shorter than FULL_CONTEXT continued by at most as many tokens as it matched), the product
        along it of each token's share of the continuations that reached it, times TRUST_BY_MATCH; branches less
        likely than min_chance are left out."""
        chances: dict[tuple[int, ...], float] = {}
        for lo, hi, matched in self._matches(context, min_context)[-GUESS_MATCHES:]:
            length = k if matched >= FULL_CONTEXT else min(k, matched)
            rows = self._continuations(lo, hi, length).tolist()
            # Branch by branch, depth by depth; one less likely than min_chance is not followed (its own are less so).
            level: list[tuple[tuple[int, ...], float, list[list[int]]]] = [((), 1.0, rows)]
            for depth in range(length):
                trust = TRUST_BY_MATCH[min(matched + depth, MAX_CONTEXT)]
                deeper = []
                for branch, chance, following in level:
                    by_token: dict[int, list[list[int]]] = {}
                    for row in following:
                        by_token.setdefault(row[depth], []).append(row)
                    for token, reaching in by_token.items():
                        child_chance = chance * len(reaching) / len(following) * trust
                        if token == _BOUNDARY or child_chance < min_chance:
                            continue  # the continuation ended there, or is too unlikely
                        child = (*branch, token)
                        chances[child] = max(chances.get(child, 0.0), child_chance)
                        deeper.append((child, child_chance, reaching))
                level = deeper
        return chances

    def _continuations(self, lo: int, hi: int, k: int) -> np.ndarray:
        """`[occurrences, k]`: the k tokens after up to MAX_OCCURRENCES of the sorted positions in [lo, hi)
        (boundaries where a sequence ends)."""
        count = min(hi - lo, MAX_OCCURRENCES)
        starts = self._positions[lo + np.arange(count) * (hi - lo) // count]  # evenly: the range is sorted by context
        ahead = np.minimum(starts[:, None] + np.arange(k), len(self._tokens) - 1)  # the last entry is a boundary
        return self._tokens[ahead]

    def _matches(self, context: list[int], min_context: int) -> list[tuple[int, int, int]]:
        """For each length n of the context's end that occurs (at least min_context, shortest first): the range of
        sorted positions whose preceding tokens end like it, and n."""
        lo, hi = 0, len(self._positions)
        found = []
        for depth in range(min(MAX_CONTEXT, len(context))):
            back = self._column(depth, lo, hi)  # sorted: the positions in [lo, hi) agree on the tokens nearer to them
            a = int(np.searchsorted(back, context[-1 - depth], "left"))
            b = int(np.searchsorted(back, context[-1 - depth], "right"))
            if a == b:
                break
            lo, hi = lo + a, lo + b
            if depth + 1 >= min_context:
                found.append((lo, hi, depth + 1))
        return found

    def _column(self, depth: int, lo: int, hi: int) -> np.ndarray:
        """The token depth + 1 places before each sorted position in [lo, hi)."""
        if depth == 0:
            return self._last[lo:hi]
        if depth == 1:
            return self._second[lo:hi]
        return self._tokens[self._positions[lo:hi] - 1 - depth]
