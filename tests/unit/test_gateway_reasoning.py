"""Reasoning apart from content (gateway/reasoning.py): each convention's cases, and a streamed answer split the same
however its text was cut into pieces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.output_formats import ReasoningParser
from gateway.reasoning import ReasoningSplitter, Split, split_whole


def streamed(parser: ReasoningParser, pieces: list[str]) -> Split:
    splitter, split = ReasoningSplitter(parser), Split()
    for piece in pieces:
        split.add(*splitter.feed(piece))
    split.add(*splitter.finish())
    return split


@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "content"),
    [
        ("qwen3", "<think>\nadd them\n</think>\n\n4", "\nadd them\n", "\n\n4"),
        ("qwen3", "  <think>x</think>y", "x", "y"),
        ("qwen3", "Just an answer", None, "Just an answer"),
        ("qwen3", "<think>never closed", "never closed", None),
        ("qwen3", "an answer that mentions </think> later", None, "an answer that mentions </think> later"),
        ("qwen3", "  <thi", None, "  <thi"),  # the start of a tag, and then the end
        ("qwen3", "<think></think>", None, None),
        ("qwen3", "<think><think></think>x", "<think>", "x"),  # inside, a tag's text is text
        ("deepseek_r1", "</think><think>", None, "<think>"),
        ("deepseek_r1", "thinking</think>answer", "thinking", "answer"),
        ("deepseek_r1", "<think>thinking</think>answer", "thinking", "answer"),  # a tag the model writes anyway
        ("deepseek_r1", "all reasoning, the tag never closed", "all reasoning, the tag never closed", None),
        ("deepseek_r1", "ends in a half tag </thi", "ends in a half tag </thi", None),
    ],
)
def test_each_convention(parser: ReasoningParser, text: str, reasoning: str | None, content: str | None) -> None:
    assert split_whole(parser, text) == Split(reasoning, content)


PARTS = st.sampled_from(["<think>", "</think>", "<", "</", "<thi", "</thin", "k>", " ", "\n", "a", "plan", "4"])


@settings(max_examples=300, deadline=None)
@given(st.lists(PARTS, max_size=12), st.data(), st.sampled_from(["qwen3", "deepseek_r1"]))
def test_a_stream_splits_as_the_whole_answer_does_however_it_was_cut(
    parts: list[str], data: st.DataObject, parser: ReasoningParser
) -> None:
    text = "".join(parts)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert streamed(parser, pieces) == split_whole(parser, text)
