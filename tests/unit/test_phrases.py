"""The phrase store (common/text/phrases.py): longest match, majority continuation, boundaries, the file."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from common.text.phrases import (
    FULL_CONTEXT,
    MAX_CONTEXT,
    MAX_OCCURRENCES,
    MIN_CHANCE,
    MIN_CONTEXT,
    TRUST_BY_MATCH,
    PhraseError,
    PhraseStore,
)


def test_the_longest_match_decides_and_its_continuation_runs_to_the_end_of_its_sequence() -> None:
    store = PhraseStore.from_sequences([[1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 7, 8]])
    assert store.continue_([9, 2, 3, 4], 5) == [7, 8]  # "9 2 3 4" occurs once; nothing follows 8 in its sequence
    assert store.continue_([1, 2, 3, 4], 5) == [5, 6]
    assert store.continue_([1, 2, 3, 4], 1) == [5]
    # "0 2 3 4" matches "2 3 4" in both: one vote each for 5 and 7, so the lower id.
    assert store.continue_([0, 2, 3, 4], 2) == [5, 6]
    assert store.num_tokens == 12


def test_the_most_frequent_continuation_wins_token_by_token() -> None:
    store = PhraseStore.from_sequences([[1, 2, 3, 7, 9], [1, 2, 3, 7, 8, 4], [1, 2, 3, 5], [6, 2, 3, 7, 8, 4]])
    assert store.continue_([0, 1, 2, 3], 4) == [7, 8, 4]  # 7 (2 of 3), then 8 or 9 (1 each: the lower), then 4


def test_the_vote_samples_all_occurrences_evenly_when_there_are_more_than_it_reads() -> None:
    assert MAX_OCCURRENCES == 64
    # 100 occurrences of "1 2 3": the 40 that start a sequence sort first and go on with 7, the other 60 with 5.
    store = PhraseStore.from_sequences([[1, 2, 3, 7]] * 40 + [[8, 1, 2, 3, 5]] * 60)
    assert store.continue_([0, 1, 2, 3], 1) == [5]  # the first 64 alone would say 7


def test_an_empty_store_and_proposals_past_the_last_sequence() -> None:
    assert PhraseStore.from_sequences([]).continue_([1, 2, 3], 4) == []
    assert PhraseStore.from_sequences([[]]).continue_([1, 2, 3], 4) == []
    store = PhraseStore.from_sequences([[1, 2, 3, 4, 5]])
    assert store.continue_([1, 2, 3], 20) == [4, 5]  # k far past the padding: the sequence's end stops it


def test_a_short_match_proposes_at_most_as_many_tokens_as_it_matched() -> None:
    assert (MIN_CONTEXT, FULL_CONTEXT) == (1, 3)
    store = PhraseStore.from_sequences([[1, 2, 3, 4, 5, 6, 7], [8, 9]])
    assert store.continue_([0, 1, 2, 3], 6) == [4, 5, 6, 7]  # 3 tokens matched: the whole continuation
    assert store.continue_([0, 2, 3], 6) == [4, 5]  # "2 3": two tokens
    assert store.continue_([0, 3], 6) == [4]  # "3": one
    assert store.continue_([2, 3], 6) == [4, 5]  # a context shorter than FULL_CONTEXT is a short match too
    assert store.continue_([0, 2, 3], 1) == [4]  # and k still caps it
    assert store.continue_([0, 2, 3], 6, min_context=FULL_CONTEXT) == []  # a caller that takes only full matches
    assert store.continue_([0, 1, 2, 3], 6, min_context=FULL_CONTEXT) == [4, 5, 6, 7]


def test_matches_stop_at_sequence_boundaries_and_unknown_tokens_give_nothing() -> None:
    store = PhraseStore.from_sequences([[1, 2, 3, 4], [5, 6, 7]])
    assert store.continue_([3, 4, 5], 3) == [6]  # "3 4 | 5" spans two sequences: only "5" matches
    assert store.continue_([5, 6, 7], 3) == []  # nothing follows the end of a sequence
    assert store.continue_([1, 2, 0], 3) == []  # 0 is in no sequence
    assert store.continue_([1, 2, 3], 0) == []


def test_it_proposes_what_a_brute_force_search_proposes() -> None:
    rng = random.Random(3)
    # 20 token kinds in ~600 tokens: each single token occurs at most 64 times, under the vote's sample.
    sequences = [[rng.randrange(20) for _ in range(rng.randrange(1, 40))] for _ in range(30)]
    store = PhraseStore.from_sequences(sequences)
    for index in range(600):
        if index % 2:  # half end in a stretch of a stored sequence, so that long matches are common
            source = rng.choice(sequences)
            end = rng.randrange(1, len(source) + 1)
            context = [rng.randrange(20) for _ in range(rng.randrange(0, 3))] + source[
                max(0, end - rng.randrange(1, 10)) : end
            ]
        else:
            context = [rng.randrange(20) for _ in range(rng.randrange(1, 12))]
        k = rng.randrange(1, 6)
        for min_context in (MIN_CONTEXT, FULL_CONTEXT):
            assert store.continue_(context, k, min_context) == _brute_force(sequences, context, k, min_context), context


def _brute_force(sequences: list[list[int]], context: list[int], k: int, min_context: int) -> list[int]:
    for n in range(min(MAX_CONTEXT, len(context)), min_context - 1, -1):
        tail = context[-n:]
        if n < FULL_CONTEXT:
            k = min(k, n)
        found = [(seq, j) for seq in sequences for j in range(n, len(seq)) if seq[j - n : j] == tail]
        if not found:
            continue
        assert len(found) <= MAX_OCCURRENCES  # (the store votes among a sample above that; the test's data stays below)
        proposal: list[int] = []
        for step in range(k):
            counts = Counter(seq[j + step] for seq, j in found if j + step < len(seq))
            if not counts:
                break
            top = max(counts.values())
            token = min(t for t, c in counts.items() if c == top)
            proposal.append(token)
            found = [(seq, j) for seq, j in found if j + step < len(seq) and seq[j + step] == token]
        return proposal
    return []


def test_guesses_carry_each_branchs_share_of_the_continuations_times_the_trust_in_its_match() -> None:
    store = PhraseStore.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 3, 4, 8], [0, 2, 3, 4, 5]])
    trust = TRUST_BY_MATCH
    guesses = store.guesses([9, 1, 2, 3], 3)
    # Longest match "1 2 3" (3 occurrences): 4 in 2 of them, then 5 or 8 in one each; 6 ends its sequence.
    assert guesses[(4,)] == pytest.approx(max(2 / 3 * trust[3], 3 / 4 * trust[2]))  # "2 3" (4 occurrences) says 4 too
    assert guesses[(6,)] == pytest.approx(1 / 3 * trust[3])
    assert guesses[(4, 5)] == pytest.approx(
        max(2 / 3 * trust[3] * 1 / 2 * trust[4], 3 / 4 * trust[2] * 2 / 3 * trust[3])
    )
    assert (6, 5) not in guesses and all(len(branch) <= 3 for branch in guesses)
    assert store.guesses([9, 1, 2, 3], 3, min_context=FULL_CONTEXT).keys() == {(4,), (6,), (4, 5), (4, 8)}
    assert store.guesses([7], 3) == {} and store.guesses([1, 2, 3], 0) == {}


def test_guesses_leave_out_branches_less_likely_than_min_chance() -> None:
    # "1 2 3" is followed 64 times: 4 in half of them, a different token in each other.
    store = PhraseStore.from_sequences([[1, 2, 3, 4]] * 32 + [[1, 2, 3, 10 + i] for i in range(32)])
    guesses = store.guesses([0, 1, 2, 3], 2)
    assert set(guesses) == {(4,)} and 1 / 64 * TRUST_BY_MATCH[3] < MIN_CHANCE


def test_the_file_round_trips_and_ids_outside_the_vocabulary_are_refused(tmp_path: Path) -> None:
    assert PhraseStore.load(tmp_path, 10) is None  # a draft folder without phrases
    PhraseStore.from_sequences([[1, 2, 3, 4], [2, 3, 4, 9]]).save(tmp_path)
    loaded = PhraseStore.load(tmp_path, 10)
    assert loaded is not None and loaded.continue_([1, 2, 3], 2) == [4]
    assert loaded.continue_([5, 2, 3, 4], 1) == [9]
    with pytest.raises(PhraseError, match="token id 9, outside the target's vocabulary of 9"):
        PhraseStore.load(tmp_path, 9)
    for bad in (
        torch.tensor([1, 2, 3, -1], dtype=torch.int32),
        torch.tensor([-1, 2, 3], dtype=torch.int32),
        torch.tensor([[-1, 2, -1]], dtype=torch.int32),
    ):
        save_file({"tokens": bad}, str(tmp_path / "phrases.safetensors"))
        with pytest.raises(PhraseError, match="starts and ends with a boundary"):
            PhraseStore.load(tmp_path, 10)
    save_file({"ids": torch.tensor([-1, -1], dtype=torch.int32)}, str(tmp_path / "phrases.safetensors"))
    with pytest.raises(PhraseError, match="no 'tokens' tensor"):
        PhraseStore.load(tmp_path, 10)
