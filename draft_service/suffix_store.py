"""An online store of the text the server has read and written, by tenant, to draft from (suffix decoding).

Real traffic repeats itself across requests: agents call the same tools with the same argument
shapes, RAG pipelines quote the same documents, code assistants rewrite the same files. The store
holds recent prompts and completions ("documents") as token ids in one ring of
`capacity` tokens, the oldest documents evicted first, and finds where the end of a sequence
occurred before: every position is chained to the previous one with the same tenant and the same
MIN_MATCH tokens before it (a hash chain, as LZ77 compressors keep), so a lookup walks only the
positions that match, newest first. Among those it keeps the ones whose match runs longest, and
their continuations become a token tree, each branch scored with the chance the target writes it.

Scoped by tenant: a position is chained only to positions of its own tenant's documents, so one
tenant's text never drafts for another's requests (a draft accepted or not changes nothing in the
output, but how fast a request runs would then depend on what another tenant wrote: a timing side
channel). Memory: 20 bytes a stored token in arrays, and a dict entry for each distinct (tenant,
MIN_MATCH tokens) of the live documents: about 70-85 bytes a token in all on text like traffic's.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MIN_MATCH = 3  # tokens a sequence's end must share with stored text to draft from it
MAX_MATCH = 32  # a match is measured up to this many tokens (longer ones rank the same)
MAX_CANDIDATES = 64  # earlier occurrences a lookup reads at most, newest first
# The chance that a continuation's next token is right, given the tokens before it were, by how
# many tokens the match ran (index: tokens matched, MIN_MATCH .. MAX_MATCH).
TRUST_BY_MATCH = {3: 0.5, 4: 0.6, 5: 0.65, 6: 0.7, 8: 0.75, 12: 0.8, 16: 0.85}


def trust(matched: int) -> float:
    """TRUST_BY_MATCH for a match of `matched` tokens (the entry at or below it)."""
    return TRUST_BY_MATCH[max(length for length in TRUST_BY_MATCH if length <= max(matched, MIN_MATCH))]


@dataclass(frozen=True)
class Match:
    """Where a context's end occurred before: how many tokens matched, and what followed each occurrence that matched
    that far (newest first, each cut at its document's end and at k tokens)."""

    matched: int
    continuations: list[list[int]]


@dataclass
class _Document:
    start: int  # absolute position of its first token
    length: int
    tenant: int


class SuffixStore:
    """Documents of token ids (each a tenant's), `capacity` tokens in all, the oldest evicted first."""

    def __init__(self, capacity: int, vocab_size: int, max_candidates: int = MAX_CANDIDATES) -> None:
        if capacity < 1 or vocab_size < 1:
            raise ValueError(f"a suffix store needs a capacity and a vocabulary, got {capacity} and {vocab_size}")
        self.capacity, self._vocab, self._max_candidates = capacity, vocab_size, max_candidates
        self._tokens = np.zeros(capacity, dtype=np.int32)  # by absolute position modulo capacity
        self._previous = np.full(capacity, -1, dtype=np.int64)  # the previous position with the same key, or -1
        self._latest: dict[int, int] = {}  # key -> the newest position with it
        self._documents: list[_Document] = []  # oldest first, from self._first
        self._starts: list[int] = []  # their starts, for bisect
        self._first = 0  # index of the oldest live document
        self._end = 0  # absolute position after the newest token
        self._tenants: dict[str, int] = {}  # name -> number, while it has live documents
        self._names: dict[int, str] = {}  # number -> name, the same tenants
        self._live: dict[int, int] = {}  # tenant number -> its live documents
        self._next_tenant = 0

    @property
    def num_tokens(self) -> int:
        """Tokens of the live documents."""
        return self._end - self._oldest

    @property
    def num_documents(self) -> int:
        return len(self._documents) - self._first

    @property
    def num_tenants(self) -> int:
        return len(self._tenants)

    @property
    def _oldest(self) -> int:
        return self._documents[self._first].start if self.num_documents else self._end

    def add(self, tenant: str, token_ids: Sequence[int]) -> None:
        """Store a document of `tenant`'s (its last `capacity` tokens), evicting the oldest documents to make room."""
        tokens = list(token_ids[-self.capacity :])
        if len(tokens) <= MIN_MATCH:
            return  # nothing in it could be matched and continued
        if any(not 0 <= token < self._vocab for token in tokens):
            raise ValueError(f"a token id is outside the vocabulary of {self._vocab}")
        while self.num_tokens + len(tokens) > self.capacity:
            self._evict_oldest()
        number = self._tenant_number(tenant)
        start, capacity = self._end, self.capacity
        previous = []
        for offset in range(MIN_MATCH, len(tokens)):
            key = self._key(number, tokens, offset)
            previous.append(self._latest.get(key, -1))
            self._latest[key] = start + offset
        slots = (start + np.arange(len(tokens))) % capacity
        self._tokens[slots] = tokens
        self._previous[slots[:MIN_MATCH]] = -1
        self._previous[slots[MIN_MATCH:]] = previous
        self._documents.append(_Document(start, len(tokens), number))
        self._starts.append(start)
        self._end = start + len(tokens)
        self._live[number] = self._live.get(number, 0) + 1

    def match(self, tenant: str, context: Sequence[int], k: int) -> Match | None:
        """The longest match of the context's end in `tenant`'s documents (at least MIN_MATCH tokens, up to
        MAX_CANDIDATES occurrences read, newest first) and what followed it; None where nothing matched."""
        number = self._tenants.get(tenant)
        if number is None or len(context) < MIN_MATCH or k < 1:
            return None
        tail = list(context[-MAX_MATCH:])
        position = self._latest.get(self._key(number, tail, len(tail)), -1)
        oldest, found = self._oldest, list[int]()
        while position >= oldest and len(found) < self._max_candidates:
            found.append(position)
            position = int(self._previous[position % self.capacity])
        if not found:
            return None
        scored = [(self._matched(position, tail), position) for position in found]
        best = max(matched for matched, _ in scored)
        return Match(best, [self._following(position, k) for matched, position in scored if matched == best])

    def _matched(self, position: int, tail: list[int]) -> int:
        """How many tokens before `position`, within its document, equal the end of `tail` (MIN_MATCH at least)."""
        start = self._document_of(position).start
        matched = MIN_MATCH
        while matched < len(tail) and position - matched - 1 >= start:
            if int(self._tokens[(position - matched - 1) % self.capacity]) != tail[-matched - 1]:
                break
            matched += 1
        return matched

    def _following(self, position: int, k: int) -> list[int]:
        document = self._document_of(position)
        end = min(position + k, document.start + document.length)
        return self._tokens[np.arange(position, end) % self.capacity].tolist()  # type: ignore[no-any-return]

    def _document_of(self, position: int) -> _Document:
        return self._documents[bisect.bisect_right(self._starts, position, lo=self._first) - 1]

    def _key(self, tenant: int, tokens: Sequence[int], end: int) -> int:
        """The chain key of the MIN_MATCH tokens before `end`, in a tenant's documents (exact: no two keys collide)."""
        key = tenant
        for token in tokens[end - MIN_MATCH : end]:
            key = key * self._vocab + token
        return key

    def _tenant_number(self, tenant: str) -> int:
        if (number := self._tenants.get(tenant)) is None:
            number = self._tenants[tenant] = self._next_tenant
            self._names[number] = tenant
            self._next_tenant += 1
        return number

    def _evict_oldest(self) -> None:
        """Drop the oldest document: its keys whose newest position it holds are forgotten (older chains end there)."""
        document = self._documents[self._first]
        slots = (document.start + np.arange(document.length)) % self.capacity
        tokens = self._tokens[slots].tolist()
        for offset in range(MIN_MATCH, document.length):
            key = self._key(document.tenant, tokens, offset)
            if self._latest.get(key) == document.start + offset:
                del self._latest[key]
        self._first += 1
        self._live[document.tenant] -= 1
        if not self._live[document.tenant]:
            del self._live[document.tenant]
            del self._tenants[self._names.pop(document.tenant)]
        if self._first > 1024 and self._first * 2 > len(self._documents):  # the evicted documents' entries let go
            del self._documents[: self._first], self._starts[: self._first]
            self._first = 0


def guesses(found: Match, k: int, scale: float = 1.0, min_chance: float = 0.0) -> dict[tuple[int, ...], float]:
    """The branches of a match's continuations, each with the chance the target writes it next: along the branch, the
    product of each token's chance given the ones before it, its share of the continuations that reached it times the
    match's trust times `scale` (how what the target wrote compared with this store's chances; never past 1);
    branches less likely than min_chance are left out."""
    chances: dict[tuple[int, ...], float] = {}
    level: list[tuple[tuple[int, ...], float, list[list[int]]]] = [((), 1.0, found.continuations)]
    for depth in range(k):
        step = trust(found.matched + depth) * scale
        deeper = []
        for branch, chance, following in level:
            by_token: dict[int, list[list[int]]] = {}
            for row in following:
                if len(row) > depth:
                    by_token.setdefault(row[depth], []).append(row)
            for token, reaching in by_token.items():
                child_chance = chance * min(1.0, len(reaching) / len(following) * step)
                if child_chance < min_chance:
                    continue
                child = (*branch, token)
                chances[child] = child_chance
                deeper.append((child, child_chance, reaching))
        level = deeper
    return chances
