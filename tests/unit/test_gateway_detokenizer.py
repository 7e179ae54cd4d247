"""Incremental detokenization with the default model's tokenizer: no broken characters, same text as a full decode."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gateway.detokenizer import IncrementalDetokenizer
from common.text.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.load(default_model_dir)


def stream(
    tokenizer: Tokenizer, token_ids: list[int], chunk_sizes: list[int] | None = None, context: list[int] | None = None
) -> list[str]:
    """Every delta the detokenizer returns, the flush last; chunk_sizes cycle (default: one id at a time)."""
    detokenizer = IncrementalDetokenizer(tokenizer, context or [])
    sizes = chunk_sizes or [1]
    deltas, start, index = [], 0, 0
    while start < len(token_ids):
        size = sizes[index % len(sizes)]
        deltas.append(detokenizer.add(token_ids[start : start + size]))
        start, index = start + size, index + 1
    deltas.append(detokenizer.flush())
    return deltas


@pytest.mark.parametrize(
    "text", ["😀🎉👩‍👩‍👧", "你好，世界。東京タワー", "Hello 世界! 😀 naïve café — ok", "🇯🇵 flags and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"]
)
def test_multi_byte_characters_split_across_tokens_never_come_out_broken(tokenizer: Tokenizer, text: str) -> None:
    token_ids = tokenizer.encode(text)
    assert any(REPLACEMENT in tokenizer.decode([token_id]) for token_id in token_ids), (
        "the text should split a character"
    )
    deltas = stream(tokenizer, token_ids)
    assert all(REPLACEMENT not in delta for delta in deltas)
    assert "".join(deltas) == text


def test_a_character_is_returned_by_the_token_that_completes_it(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("😀")
    assert len(token_ids) > 1
    deltas = stream(tokenizer, token_ids)
    assert deltas[:-1] == [""] * (len(token_ids) - 1) + ["😀"]
    assert deltas[-1] == ""


def test_flush_returns_an_incomplete_character_as_replacement(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("ok 😀")[:-1]  # the emoji's last byte is missing
    deltas = stream(tokenizer, token_ids)
    assert REPLACEMENT not in "".join(deltas[:-1])
    assert deltas[-1].endswith(REPLACEMENT)
    assert "".join(deltas) == tokenizer.decode(token_ids)


def test_prompt_context_keeps_word_boundaries(tokenizer: Tokenizer) -> None:
    prompt_ids = tokenizer.encode("The capital of France is")
    full_ids = tokenizer.encode("The capital of France is Paris, a city.")
    assert full_ids[: len(prompt_ids)] == prompt_ids
    deltas = stream(tokenizer, full_ids[len(prompt_ids) :], context=prompt_ids)
    assert deltas[0] == " Paris"
    assert "".join(deltas) == " Paris, a city."


def test_special_tokens_are_left_out(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("Hi") + list(tokenizer.eos_token_ids)
    assert "".join(stream(tokenizer, token_ids)) == "Hi"


def test_chunks_of_several_ids_give_the_same_text(tokenizer: Tokenizer) -> None:
    text = "Streaming 😀 in chunks of three 世界 ids."
    token_ids = tokenizer.encode(text)
    assert "".join(stream(tokenizer, token_ids, chunk_sizes=[3, 1, 2])) == text


# Mostly characters of 2-4 UTF-8 bytes, which byte-level BPE splits across tokens.
decodable_text = st.text(
    alphabet=st.one_of(
        st.characters(min_codepoint=0x20, max_codepoint=0x7E),
        st.characters(min_codepoint=0xA0, max_codepoint=0x24F),
        st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),
        st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),
        st.characters(exclude_categories=["Cs"], exclude_characters=REPLACEMENT),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(text=decodable_text, seed=st.integers(0, 2**32 - 1))
def test_incremental_output_equals_full_decode(tokenizer: Tokenizer, text: str, seed: int) -> None:
    token_ids = tokenizer.encode(text)
    assume(REPLACEMENT not in tokenizer.decode(token_ids))  # the vocabulary lacks a few byte tokens
    rng = random.Random(seed)
    chunk_sizes = [rng.randint(1, 4) for _ in range(8)]
    deltas = stream(tokenizer, token_ids, chunk_sizes)
    assert "".join(deltas) == tokenizer.decode(token_ids)
    assert all(REPLACEMENT not in delta for delta in deltas)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_random_ids_concatenate_to_full_decode(tokenizer: Tokenizer, data: st.DataObject) -> None:
    token_ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=30))
    context = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=8))
    deltas = stream(tokenizer, token_ids, context=context)
    assert all(not delta.endswith(REPLACEMENT) for delta in deltas[:-1])
    full = tokenizer.decode(context + token_ids)
    # Context that ends inside a character is out of scope: a full decode would merge it with the output.
    if not tokenizer.decode(context).endswith(REPLACEMENT):
        assert "".join(deltas) == full[len(tokenizer.decode(context)) :]
