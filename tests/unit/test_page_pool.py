"""The page pool and its prefix cache: worked examples, then the pool as a state machine under hypothesis."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from common.page_pool import PagePool


def test_a_second_turn_reuses_the_first_turns_full_pages_but_computes_its_last_token() -> None:
    pool = PagePool(num_pages=8, page_size=4)
    first = list(range(10))
    assert pool.admit("turn-1", first) == 0
    pool.register("turn-1", first)  # 2 full pages computed; the third holds 2 tokens
    pool.release("turn-1")
    assert pool.num_cached == 2 and pool.num_available == 8
    second = first + [50, 51, 52, 53]
    assert pool.admit("turn-2", second) == 8  # the two full pages, shared
    assert pool.block_table("turn-2")[:2] == pool.cached_prefix(first + [0])
    assert pool.counters.num_queried_tokens == 24 and pool.counters.num_hit_tokens == 8
    exactly = list(range(8))
    assert (
        len(pool.cached_prefix(exactly)) == 1
    )  # a prompt of exactly two pages computes its last token: one page is shared


def test_a_different_token_anywhere_before_a_page_means_another_page() -> None:
    pool = PagePool(num_pages=8, page_size=2)
    pool.admit("a", [1, 2, 3, 4, 5])
    pool.register("a", [1, 2, 3, 4, 5])
    assert len(pool.cached_prefix([1, 2, 3, 4, 9])) == 2
    assert len(pool.cached_prefix([9, 2, 3, 4, 5])) == 0  # same second page, other prefix: not shared
    assert len(pool.cached_prefix([1, 2, 9, 4, 5])) == 1


def test_pages_are_shared_only_under_the_same_salt() -> None:
    pool = PagePool(num_pages=16, page_size=2)
    secret = [7, 7, 1, 2, 3, 4, 5]
    pool.admit("alice", secret, salt="alice")
    pool.register("alice", secret)
    pool.release("alice")
    assert (
        pool.cached_prefix(secret, "alice") and not pool.cached_prefix(secret) and not pool.cached_prefix(secret, "bob")
    )
    assert pool.admit("mallory", secret) == 0  # the guess, unsalted: nothing found
    assert pool.admit("bob", secret, salt="bob") == 0
    assert pool.admit("alice-again", secret, salt="alice") == 6
    # Nor does a salt that reads like a token sequence meet the unsalted chain (salts and page numbers never meet).
    pool.register("mallory", secret)
    assert len(pool.cached_prefix(secret, "")) == 3 and not pool.cached_prefix(secret, "1")


def test_cached_pages_are_evicted_least_recently_released_first_and_only_when_needed() -> None:
    pool = PagePool(num_pages=4, page_size=2)
    for name, tokens in (("a", [1, 1, 0]), ("b", [2, 2, 0])):
        assert pool.admit(name, tokens) == 0
        pool.register(name, tokens)  # one full page each; the partial one is never cached
    pool.release("a")
    pool.release("b")
    assert pool.num_cached == 2 and pool.num_available == 4
    assert pool.admit("c", [3, 3, 3, 3, 0]) == 0  # 3 pages: the two free ones, then a's (released first)
    assert pool.cached_prefix([1, 1, 0]) == [] and len(pool.cached_prefix([2, 2, 0])) == 1
    assert pool.admit("d", [4, 4, 4]) is None  # two pages wanted, one available: refused, nothing changed
    assert "d" not in pool and pool.num_available == 1 and len(pool.cached_prefix([2, 2, 0])) == 1


def test_rejected_draft_pages_go_back_but_computed_registered_pages_cannot() -> None:
    pool = PagePool(num_pages=6, page_size=2)
    pool.admit("a", [1, 2, 3])
    assert pool.grow("a", 3 + 4)  # four draft tokens: pages for 7 positions
    assert len(pool.block_table("a")) == 4 and pool.num_available == 2
    pool.truncate("a", 4)  # one draft accepted
    assert len(pool.block_table("a")) == 2 and pool.num_available == 4
    pool.register("a", [1, 2, 3, 9])
    with pytest.raises(ValueError, match="registered"):
        pool.truncate("a", 2)
    assert not pool.grow("a", 4 + 2 * 5)  # more than is available: nothing taken
    assert len(pool.block_table("a")) == 2


def test_admission_keeps_the_watermark_available() -> None:
    pool = PagePool(num_pages=6, page_size=2)
    assert pool.admit("a", [1, 2, 3, 4], keep_free=5) is None  # 2 pages would leave 4, fewer than 5
    assert pool.admit("a", [1, 2, 3, 4], keep_free=4) == 0 and pool.num_available == 4


def test_without_the_prefix_cache_nothing_is_shared_or_kept() -> None:
    pool = PagePool(num_pages=4, page_size=2, prefix_cache=False)
    pool.admit("a", [1, 2, 3])
    pool.register("a", [1, 2, 3])
    pool.release("a")
    assert pool.num_cached == 0 and pool.num_used == 0
    assert pool.admit("b", [1, 2, 3]) == 0


def test_a_sequence_can_decline_what_is_cached() -> None:
    pool = PagePool(num_pages=8, page_size=2)
    pool.admit("a", [1, 2, 3])
    pool.register("a", [1, 2, 3])
    assert pool.admit("b", [1, 2, 3], share=False) == 0
    assert pool.block_table("b")[0] != pool.block_table("a")[0]


PAGE_SIZE = 2
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=9)  # a small alphabet: prompts share prefixes often


class PagePoolMachine(RuleBasedStateMachine):
    """Sequences come, grow, speculate, end; a model of what each page holds checks every prefix hit."""

    sequences = Bundle("sequences")

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(num_pages=10, page_size=PAGE_SIZE)
        self.tokens: dict[str, list[int]] = {}  # per sequence: the tokens whose keys and values are computed
        self.content: dict[int, tuple[int, ...]] = {}  # per page: the tokens its positions were last written with
        self.count = 0

    @initialize()
    def empty(self) -> None:
        assert self.pool.num_available == 10

    def _write(self, seq_id: str, tokens: list[int], start: int) -> None:
        """Compute positions start.. of the sequence: only pages it alone holds may be written."""
        table = self.pool.block_table(seq_id)
        for index in range(start // PAGE_SIZE, self.pool.pages_for(len(tokens))):
            page = table[index]
            assert self.pool._pages[page].ref_count == 1, f"page {page} is written while shared"
            self.content[page] = tuple(tokens[index * PAGE_SIZE : (index + 1) * PAGE_SIZE])

    @rule(target=sequences, tokens=TOKENS)
    def admit(self, tokens: list[int]) -> str:
        seq_id = f"s{self.count}"
        self.count += 1
        hit = self.pool.cached_prefix(tokens)
        for index, page in enumerate(hit):  # a cached page holds exactly what recomputing it would
            assert self.content[page] == tuple(tokens[index * PAGE_SIZE : (index + 1) * PAGE_SIZE])
        cached = self.pool.admit(seq_id, tokens)
        if cached is None:
            return seq_id  # refused (no room): the bundle's later rules skip it
        assert cached == len(hit) * PAGE_SIZE < len(tokens)
        self._write(seq_id, tokens, cached)
        self.pool.register(seq_id, tokens)
        self.tokens[seq_id] = list(tokens)
        return seq_id

    @rule(seq_id=sequences, new=TOKENS, num_accepted=st.integers(0, 9))
    def step(self, seq_id: str, new: list[int], num_accepted: int) -> None:
        """A verify step: pages for the last token's successors, then all but the rejected ones stand."""
        if seq_id not in self.tokens:
            return
        tokens = self.tokens[seq_id]
        if not self.pool.grow(seq_id, len(tokens) + len(new)):
            return  # the scheduler would preempt someone; nothing was taken
        self._write(seq_id, tokens + new, len(tokens))
        standing = tokens + new[: min(num_accepted, len(new))]
        self.pool.truncate(seq_id, len(standing))
        if self.pool.block_table(seq_id):  # the last page holds only what stands now
            last = self.pool.block_table(seq_id)[-1]
            start = (self.pool.pages_for(len(standing)) - 1) * PAGE_SIZE
            self.content[last] = tuple(standing[start : start + PAGE_SIZE])
        self.pool.register(seq_id, standing)
        self.tokens[seq_id] = standing

    @rule(seq_id=consumes(sequences))
    def release(self, seq_id: str) -> None:
        if self.tokens.pop(seq_id, None) is not None:
            self.pool.release(seq_id)

    @invariant()
    def every_page_is_free_cached_or_held_once(self) -> None:
        pool = self.pool
        holders = Counter(page for seq_id in self.tokens for page in pool.block_table(seq_id))
        free, cached = set(pool._free), set(pool._cached)
        assert len(free) == len(pool._free) and not free & cached
        for page, state in enumerate(pool._pages):
            assert state.ref_count == holders[page] >= 0
            assert (page in free) + (page in cached) + (state.ref_count > 0) == 1, f"page {page} is not in one place"
            assert page not in free or state.key is None
            assert page not in cached or state.key is not None
        for key, page in pool._index.items():
            assert pool._pages[page].key == key
        assert pool.num_available == len(free) + len(cached)

    def teardown(self) -> None:
        for seq_id in list(self.tokens):
            self.pool.release(seq_id)
        self.tokens.clear()
        self.every_page_is_free_cached_or_held_once()
        assert self.pool.num_available == self.pool.num_pages  # every page is accounted for once all requests end


TestPagePoolMachine = PagePoolMachine.TestCase
TestPagePoolMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
