"""The suffix store (draft_service/suffix_store.py) against a naive reference: documents kept whole in a list, every
occurrence found by scanning them. Same matches, same continuations, same bound, and no tenant's text in another's."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from draft_service.suffix_store import MAX_MATCH, MIN_MATCH, Match, SuffixStore, guesses

VOCAB = 3  # few tokens: many repeats, long matches, chains that cross evictions
TENANTS = ("", "a", "b")


class NaiveStore:
    """Documents in a list, oldest first; a lookup scans every one of the tenant's, newest first."""

    def __init__(self, capacity: int, max_candidates: int) -> None:
        self.capacity, self.max_candidates = capacity, max_candidates
        self.documents: list[tuple[str, list[int]]] = []

    @property
    def num_tokens(self) -> int:
        return sum(len(tokens) for _, tokens in self.documents)

    def add(self, tenant: str, token_ids: Sequence[int]) -> None:
        tokens = list(token_ids[-self.capacity :])
        if len(tokens) <= MIN_MATCH:
            return
        while self.num_tokens + len(tokens) > self.capacity:
            self.documents.pop(0)
        self.documents.append((tenant, tokens))

    def match(self, tenant: str, context: Sequence[int], k: int) -> Match | None:
        tail = list(context[-MAX_MATCH:])
        if len(tail) < MIN_MATCH or k < 1:
            return None
        found: list[tuple[list[int], int]] = []
        for owner, tokens in reversed(self.documents):
            if owner != tenant:
                continue
            for position in range(len(tokens) - 1, MIN_MATCH - 1, -1):
                if tokens[position - MIN_MATCH : position] == tail[-MIN_MATCH:]:
                    found.append((tokens, position))
        found = found[: self.max_candidates]
        if not found:
            return None

        def matched(tokens: list[int], position: int) -> int:
            length = MIN_MATCH
            while (
                length < len(tail) and position - length - 1 >= 0 and tokens[position - length - 1] == tail[-length - 1]
            ):
                length += 1
            return length

        best = max(matched(tokens, position) for tokens, position in found)
        return Match(
            best, [tokens[position : position + k] for tokens, position in found if matched(tokens, position) == best]
        )


documents = st.lists(st.integers(0, VOCAB - 1), max_size=14)


class StoreAgainstReference(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = SuffixStore(capacity=24, vocab_size=VOCAB, max_candidates=5)
        self.reference = NaiveStore(capacity=24, max_candidates=5)

    @rule(tenant=st.sampled_from(TENANTS), tokens=documents)
    def add(self, tenant: str, tokens: list[int]) -> None:
        self.store.add(tenant, tokens)
        self.reference.add(tenant, tokens)

    @rule(tenant=st.sampled_from(TENANTS), context=documents, k=st.integers(0, 6))
    def match(self, tenant: str, context: list[int], k: int) -> None:
        assert self.store.match(tenant, context, k) == self.reference.match(tenant, context, k)

    @invariant()
    def bounded(self) -> None:
        assert self.store.num_tokens == self.reference.num_tokens <= self.store.capacity
        assert self.store.num_documents == len(self.reference.documents)
        assert self.store.num_tenants == len({tenant for tenant, _ in self.reference.documents})


TestStoreAgainstReference = StoreAgainstReference.TestCase
TestStoreAgainstReference.settings = settings(max_examples=400, stateful_step_count=40, deadline=None)


@given(
    ours=st.lists(st.lists(st.integers(0, 4), min_size=4, max_size=20), max_size=6),
    theirs=st.lists(st.lists(st.integers(0, 9), min_size=4, max_size=20), max_size=6),
    context=st.lists(st.integers(0, 9), min_size=3, max_size=12),
)
@settings(max_examples=200, deadline=None)
def test_a_tenant_is_never_offered_a_token_only_another_tenant_wrote(
    ours: list[list[int]], theirs: list[list[int]], context: list[int]
) -> None:
    """Tenant "ours" writes tokens 0-4 only; "theirs" writes 0-9, in any order with ours. Whatever the context, what
    "ours" is offered holds no token of 5-9."""
    store = SuffixStore(capacity=200, vocab_size=10)
    for index in range(max(len(ours), len(theirs))):
        for tenant, texts in (("theirs", theirs), ("ours", ours)):
            if index < len(texts):
                store.add(tenant, texts[index])
    found = store.match("ours", context, 6)
    offered = {token for branch in guesses(found, 6) for token in branch} if found else set()
    assert offered <= set(range(5))


def test_the_longest_match_wins_and_its_continuations_branch_by_how_often_they_followed() -> None:
    store = SuffixStore(capacity=1000, vocab_size=100)
    store.add("t", [1, 2, 3, 4, 10, 11])
    store.add("t", [9, 2, 3, 4, 20, 21])  # matches 2 3 4 only
    store.add("t", [1, 2, 3, 4, 10, 12])
    store.add("t", [1, 2, 3, 4, 30, 31])
    found = store.match("t", [7, 1, 2, 3, 4], 2)
    assert found == Match(4, [[30, 31], [10, 12], [10, 11]])  # newest first; the shorter match left out
    chances = guesses(found, 2)
    assert chances[(10,)] == pytest.approx(2 / 3 * 0.6) and chances[(30,)] == pytest.approx(1 / 3 * 0.6)
    assert chances[(10, 11)] == pytest.approx(chances[(10,)] * 1 / 2 * 0.65)
    assert store.match("t", [5, 6, 7], 2) is None and store.match("other", [2, 3, 4], 2) is None


def test_a_document_longer_than_the_store_keeps_its_end_and_tokens_outside_the_vocabulary_are_refused() -> None:
    store = SuffixStore(capacity=8, vocab_size=50)
    store.add("t", [1, 2, 3])
    store.add("t", list(range(20)))
    assert store.num_tokens == 8 and store.num_documents == 1
    assert store.match("t", [13, 14, 15], 3) == Match(3, [[16, 17, 18]])
    with pytest.raises(ValueError, match="outside the vocabulary of 50"):
        store.add("t", [1, 2, 3, 50])
    assert store.num_tokens == 8  # a refused document changes nothing


def test_a_million_token_prompt_and_ten_thousand_tenants_stay_inside_the_bound() -> None:
    store = SuffixStore(capacity=50_000, vocab_size=50_000)
    huge = [index % 49_999 for index in range(1_000_000)]
    store.add("big", huge)
    assert store.num_tokens == 50_000 and store.num_documents == 1
    for tenant in range(10_000):
        store.add(f"tenant-{tenant}", [tenant % 7, 1, 2, 3, tenant % 11, 5, 6])
        assert store.num_tokens <= store.capacity
    assert store.num_tenants == store.num_documents == 50_000 // 7  # the oldest dropped, the big prompt first
    assert len(store._latest) <= store.num_tokens  # keys of dropped text are forgotten with it
    assert store.match("big", huge[:10], 3) is None and store.match("tenant-0", [0, 1, 2, 3], 2) is None
    assert store.match("tenant-9999", [1, 2, 3], 2) == Match(3, [[9999 % 11, 5]])
