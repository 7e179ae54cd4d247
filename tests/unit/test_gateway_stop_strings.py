"""Stop strings across chunks, several at once, at the very start; and the RequestOutput that cuts tokens there too."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.output import RequestOutput
from gateway.stop_strings import StopStringMatcher, partial_match_length
from common.text.tokenizer import Tokenizer


def run(stop_strings: list[str], chunks: list[str]) -> tuple[list[str], str | None]:
    """The text sent for each chunk (the flush last, if no match earlier) and the stop string matched."""
    matcher = StopStringMatcher(stop_strings)
    sent = []
    for chunk in chunks:
        check = matcher.feed(chunk)
        sent.append(check.text)
        if check.matched is not None:
            return sent, check.matched
    sent.append(matcher.flush())  # the end of the text can still settle a held match
    return sent, matcher.matched


def test_stop_string_spanning_chunks_is_cut_with_everything_after() -> None:
    sent, matched = run(["###"], ["Hello #", "#", "# tail"])
    assert matched == "###"
    assert "".join(sent) == "Hello "
    assert sent == ["Hello ", "", ""]


def test_only_a_possible_stop_prefix_is_held_back() -> None:
    sent, matched = run(["END"], ["abcE", "Nx", "yz"])
    assert matched is None
    assert sent == ["abc", "ENx", "yz", ""]


def test_held_text_is_released_when_the_output_ends() -> None:
    sent, matched = run(["STOP"], ["all done ST"])
    assert matched is None
    assert sent == ["all done ", "ST"]


def test_earliest_of_several_stop_strings_wins() -> None:
    sent, matched = run(["world", "lo w", "Hel"], ["xx Hello world"])
    assert matched == "Hel"
    assert sent == ["xx "]
    sent, matched = run(["world", "o w"], ["Hello wo", "rld"])
    assert matched == "o w"
    assert "".join(sent) == "Hell"


def test_stop_string_at_the_very_start() -> None:
    sent, matched = run(["<stop>"], ["<st", "op> and more"])
    assert matched == "<stop>"
    assert sent == ["", ""]


def test_overlapping_prefix_is_found() -> None:
    sent, matched = run(["aab"], ["a", "a", "a", "b"])
    assert matched == "aab"
    assert "".join(sent) == "a"


def test_multi_character_unicode_stop_string() -> None:
    sent, matched = run(["世界"], ["你好世", "界!"])
    assert matched == "世界"
    assert "".join(sent) == "你好"


def test_no_stop_strings_passes_everything_through() -> None:
    assert run([], ["a", "b"]) == (["a", "b", ""], None)


def test_feed_after_a_match_raises() -> None:
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("ax").matched == "x"
    with pytest.raises(RuntimeError):
        matcher.feed("more")


def test_partial_match_length() -> None:
    assert partial_match_length("hello wor", ["world", "or"]) == 3
    assert partial_match_length("hello", ["world"]) == 0
    assert partial_match_length("abc", ["abc"]) == 0  # a whole match is not a partial one


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab#\n", max_size=40),
    stop_strings=st.lists(st.text(alphabet="ab#\n", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_chunked_matching_equals_matching_the_whole_text(text: str, stop_strings: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(cut for cut in cuts if cut <= len(text))})
    chunks = [text[start:end] for start, end in zip(bounds, bounds[1:], strict=False)]
    sent, matched = run(stop_strings, chunks)
    starts = [start for stop in stop_strings if (start := text.find(stop)) >= 0]
    if starts:
        assert matched is not None and text.find(matched) == min(starts)
        assert "".join(sent) == text[: min(starts)]
    else:
        assert matched is None and "".join(sent) == text


# ---------------------------------------------------------------- RequestOutput: text, ids and usage per chunk


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.load(default_model_dir)


def test_output_cuts_tokens_after_the_one_completing_a_stop_string(tokenizer: Tokenizer) -> None:
    prompt_ids = tokenizer.encode("Count:")
    ids = tokenizer.encode(" one, two, three, four")
    output = RequestOutput(tokenizer, prompt_ids, [", thr"])
    chunk = output.add(ids, None)  # one delta holding everything, as after a speculative step
    assert chunk.text == " one, two"
    assert chunk.finish_reason == "stop" and chunk.stop_string == ", thr"
    assert tokenizer.decode(chunk.token_ids).endswith(" three")  # up to the token that completed the stop string
    assert len(chunk.token_ids) < len(ids)
    assert chunk.num_completion_tokens == len(chunk.token_ids)
    assert chunk.num_prompt_tokens == len(prompt_ids)
    with pytest.raises(RuntimeError):
        output.add(ids, None)


def test_output_stop_string_across_deltas_and_at_the_start(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello world")
    output = RequestOutput(tokenizer, [], ["Hello"])
    chunk = output.add(ids[:1], None)
    assert (chunk.text, chunk.finish_reason) == ("", "stop")
    output = RequestOutput(tokenizer, [], ["o wo"])
    first, second = output.add(ids[:1], None), output.add(ids[1:], None)
    assert (first.text, first.finish_reason) == ("Hell", None)
    assert (second.text, second.finish_reason) == ("", "stop")


def test_output_finishing_flushes_held_text_and_reports_usage(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Go 😀")
    output = RequestOutput(tokenizer, [], ["😀!"])
    chunks = [output.add([token_id], None) for token_id in ids[:-1]]
    last = output.add(ids[-1:] + list(tokenizer.eos_token_ids), "stop")
    assert "".join(chunk.text for chunk in [*chunks, last]) == "Go 😀"
    assert last.finish_reason == "stop" and last.stop_string is None
    assert last.num_completion_tokens == len(ids) + len(tokenizer.eos_token_ids)
    assert output.finish_reason == "stop"


def test_output_length_finish_keeps_the_scheduler_reason(tokenizer: Tokenizer) -> None:
    output = RequestOutput(tokenizer, [], [])
    chunk = output.add(tokenizer.encode("abc"), "length")
    assert (chunk.text, chunk.finish_reason) == ("abc", "length")


def test_a_longer_stop_string_that_starts_earlier_wins_across_chunks() -> None:
    """'a' completes first, but '#aa' began earlier: the text is cut where '#aa' begins, as on the whole text."""
    sent, matched = run(["a", "#aa"], ["#a", "a"])
    assert "".join(sent) == "" and matched == "#aa"
    sent, matched = run(["a", "#aa"], ["#a", "b"])  # '#aa' fails: the earlier 'a' wins
    assert "".join(sent) == "#" and matched == "a"
