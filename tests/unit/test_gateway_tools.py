"""Tool calling's pure parts (gateway/tools.py): the request's tools checked, the grammar of a forced call, and each
format's parser, which reads a malformed call as text and never fails."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.api_error import ApiError
from gateway.openai_chat_prompt import chat_prompt
from gateway.output_formats import ToolCallParser
from gateway.tools import CallGate, ToolAsk, ToolCall, call_grammar, parse_calls, tool_ask
from common.text.structured import grammar_problem, grammar_tokenizer
from common.text.tokenizer import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "today's weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "chatml_tools.jinja"


def ask(choice: object = "auto", parallel: bool | None = None) -> ToolAsk:
    body: dict[str, Any] = {"tools": [WEATHER, TIME], "tool_choice": choice}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    checked = tool_ask(body)
    assert checked is not None
    return checked


def test_tool_choice_says_what_is_called() -> None:
    assert tool_ask({}) is None and tool_ask({"tools": [WEATHER], "tool_choice": "none"}) is None
    assert tool_ask({"tools": []}) is None
    assert ask().choice == "auto" and not ask().constrained and ask().parallel
    assert ask("required").constrained and not ask("required", parallel=False).parallel
    assert ask({"type": "function", "function": {"name": "get_time"}}).choice == "get_time"
    assert tool_ask({"tools": [WEATHER]}).choice == "auto"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": "get_weather"}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_a_wrong_tools_field_is_refused_by_name(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        tool_ask(body)
    assert (caught.value.status, caught.value.param) == (400, param)


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_calls_grammar_compiles_for_the_model(
    parser: ToolCallParser, choice: object, default_model_dir: Path
) -> None:
    tokenizer = Tokenizer.load(default_model_dir)
    ll = grammar_tokenizer(tokenizer.backend_json(), tokenizer.vocab_size, tokenizer.eos_token_ids)
    for parallel in (True, False):
        assert grammar_problem(call_grammar(ask(choice, parallel), parser), ll) == ""


def test_hermes_calls_and_the_text_around_them() -> None:
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = parse_calls("hermes", text, ask())
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert len(parse_calls("hermes", text, ask(parallel=False))[1]) == 1  # one call at most: the first
    assert parse_calls("hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', ask())[0] is None


@pytest.mark.parametrize(
    "text",
    [
        "No call here.",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}',  # unclosed
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # bad JSON
        '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',  # not a tool offered
        '<tool_call>{"name": "get_time", "arguments": "now"}</tool_call>',  # arguments not an object
        '<tool_call>["get_time"]</tool_call>',
    ],
)
def test_a_malformed_hermes_call_is_text(text: str) -> None:
    assert parse_calls("hermes", text, ask()) == (text, [])


def test_llama3_json_calls() -> None:
    content, calls = parse_calls(
        "llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', ask()
    )
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    two = '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Rome"}}'
    assert [c.name for c in parse_calls("llama3_json", two, ask())[1]] == ["get_time", "get_weather"]
    for text in (
        "Sure! It is sunny.",
        '{"name": "get_time", "parameters": {}} and more',
        '{"name": "get_time"',
        '{"name": "nope", "parameters": {}}',
    ):
        assert parse_calls("llama3_json", text, ask()) == (text, [])


def test_messages_carry_calls_and_results_to_a_template_that_takes_tools(default_model_dir: Path) -> None:
    body = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        ]
    }
    prompt = chat_prompt(body)
    text = Tokenizer.load(default_model_dir, FIXTURE).render_chat(prompt.messages, tools=[WEATHER])
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text and "<tool_response>\nsunny, 21 C" in text
    assert not Tokenizer.load(default_model_dir).template_takes_tools
    assert Tokenizer.load(default_model_dir, FIXTURE).template_takes_tools
    bad = {
        "messages": [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "not json"}}],
            }
        ]
    }
    with pytest.raises(ApiError) as caught:
        chat_prompt(bad)
    assert caught.value.param == "messages[0].tool_calls[0].function.arguments"


def streamed(parser: ToolCallParser, pieces: list[str], asked: ToolAsk) -> tuple[str, list[tuple[str, str]]]:
    """What a stream sends: the content and calls let go piece by piece, then what is left at the end."""
    gate = CallGate(parser, asked)
    content: list[str] = []
    calls: list[ToolCall] = []
    for piece in [*pieces, None]:
        now, new_calls = gate.feed(piece) if piece is not None else gate.finish()
        content.append(now)
        calls.extend(new_calls)
    assert gate.num_calls == len(calls)
    return "".join(content), [(call.name, call.arguments) for call in calls]


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
        ("hermes", "Plain text with a < sign and <tool_ in it"),
        ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> and after'),
        ("hermes", '<tool_call>{"name": "get_time", "arguments": {'),  # cut short: text
        (
            "hermes",
            'A <tool_call>{"name": "launch", "arguments": {}}</tool_call> B <tool_call>{"name": "get_time", '
            '"arguments": {}}</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
            '</tool_call> C <tool_call>{"name": "get_weather"',
        ),  # text, two calls, text, a call cut short
        ("llama3_json", '  {"name": "get_weather", "parameters": {"city": "Oslo"}}'),
        ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}'),
        ("llama3_json", "Sure, it is sunny. {not a call}"),
        ("llama3_json", "<|python"),
    ],
)
def test_a_streamed_answer_is_read_as_the_whole_one_however_it_was_cut(parser: ToolCallParser, text: str) -> None:
    for parallel in (True, False):
        content, calls = parse_calls(parser, text, ask(parallel=parallel))
        whole = ((content or "").strip(), [(call.name, call.arguments) for call in calls])
        for size in range(1, len(text) + 1):
            pieces = [text[at : at + size] for at in range(0, len(text), size)]
            got, got_calls = streamed(parser, pieces, ask(parallel=parallel))
            assert (got.strip(), got_calls) == whole, size


def test_plain_text_streams_at_once_and_a_call_as_soon_as_its_block_closes() -> None:
    gate = CallGate("hermes", ask())
    assert gate.feed("The weather ") == ("The weather ", []) and gate.feed("is fine <tool") == ("is fine ", [])
    assert gate.feed('_call>{"name": "get_time", ') == ("", []) and gate.held == '<tool_call>{"name": "get_time", '
    assert gate.feed('"arguments": {}}</tool_call> then') == (" then", [ToolCall("get_time", "{}")])
    assert gate.finish() == ("", []) and gate.num_calls == 1
    forced = CallGate("llama3_json", ask("required"))
    assert forced.feed('{"name": "get_time", "parameters": {}}') == ("", [])  # held until the answer ends
    assert forced.finish() == ("", [ToolCall("get_time", "{}")])


def test_a_call_closed_before_a_block_left_open_is_still_a_call() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_weather", "ar'
    assert parse_calls("hermes", text, ask()) == (
        '<tool_call>{"name": "get_weather", "ar',
        [ToolCall("get_time", "{}")],
    )
