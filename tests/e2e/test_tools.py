"""Tool calling through the stack with the openai SDK: a gateway beside the stack's own with `--tool-call-parser
hermes` and a ChatML template that offers tools (tests/fixtures/chatml_tools.jinja; the embedded model's own takes
none). With `required` or a named function a grammar makes the answer a call, so the loop (call, tool result, final
answer) runs on the real model, whole and streamed; `auto` lets the model choose."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from specserve.stack import StackConfig
from tests.e2e.stack import Stack, running_stack
from tests.e2e.test_reasoning import start_gateway

MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "chatml_tools.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Today's weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris today?"}]


@pytest.fixture(scope="module")
def tools_api(fp32_stack: Stack) -> openai.OpenAI:
    port = start_gateway(fp32_stack, "gateway-tools", "--tool-call-parser", "hermes", "--chat-template", str(TEMPLATE))
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")


def ask(api: openai.OpenAI, messages: list[Any], **options: Any) -> Any:
    return api.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, CLOCK], max_tokens=64, temperature=0, **options
    )


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_then_the_tools_result_then_an_answer(tools_api: openai.OpenAI, tool_choice: Any) -> None:
    reply = ask(tools_api, QUESTION, tool_choice=tool_choice, parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in ("get_weather", "get_time")
    if tool_choice != "required":
        assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments, dict)
    # The loop: the call and its result go back; without tool_choice the model answers in text (or calls again).
    messages = [
        *QUESTION,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    final = ask(tools_api, messages, tool_choice="none")
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.content
    assert not final.choices[0].message.tool_calls


def test_streamed_calls_come_as_tool_call_deltas(tools_api: openai.OpenAI) -> None:
    whole = ask(tools_api, QUESTION, tool_choice="required", parallel_tool_calls=False)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for event in ask(tools_api, QUESTION, tool_choice="required", parallel_tool_calls=False, stream=True):
        for choice in event.choices:
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:  # as OpenAI's stream: the id and the name first, the arguments after
                    assert delta.id and delta.function.name and delta.function.arguments == ""
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.choices[0].message.tool_calls
    ]


def test_auto_lets_the_model_choose_and_a_plain_answer_stays_text(tools_api: openai.OpenAI) -> None:
    reply = ask(tools_api, QUESTION, tool_choice="auto")
    choice = reply.choices[0]
    if choice.message.tool_calls:  # the model called: each call is well formed, to a tool offered
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert call.function.name in ("get_weather", "get_time") and isinstance(
                json.loads(call.function.arguments), dict
            )
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content


def test_tools_are_refused_where_they_cannot_be_served(fp32_stack: Stack, tools_api: openai.OpenAI) -> None:
    plain = openai.OpenAI(
        base_url=f"http://127.0.0.1:{fp32_stack.addresses.http_port}/v1", api_key="unused", max_retries=0
    )
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):  # the stack's own gateway reads no calls
        ask(plain, QUESTION)
    with pytest.raises(openai.BadRequestError, match="cannot follow"):
        ask(tools_api, QUESTION, tool_choice="required", response_format={"type": "json_object"})
    # With tool_choice none the tools are not offered at all: the answer is the one without them.
    without = tools_api.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=64, temperature=0)
    assert ask(tools_api, QUESTION, tool_choice="none").choices[0].message.content == without.choices[0].message.content


def test_a_forced_call_is_the_same_as_without_speculation(
    tools_api: openai.OpenAI, fp32_stack: Stack, default_model_dir: Path, tmp_path: Path
) -> None:
    """The grammar's forced tokens are verified as drafts (the stack's default); a stack that verifies none
    (--num-speculative-tokens 0) gives the same call, token for token."""
    before = {s.source: s.num_accepted_draft_tokens for s in fp32_stack.info().speculation.sources}
    forced = ask(tools_api, QUESTION, tool_choice="required", parallel_tool_calls=False)
    after = {s.source: s.num_accepted_draft_tokens for s in fp32_stack.info().speculation.sources}
    assert after.get("grammar", 0) > before.get("grammar", 0)  # the call's forced tokens were verified as drafts
    config = StackConfig(
        default_model_dir,
        dtype="float32",
        num_workers=1,
        max_num_seqs=4,
        num_threads_per_worker=1,
        num_speculative_tokens=0,
        tool_call_parser="hermes",
        chat_template=TEMPLATE,
    )
    with running_stack(config, tmp_path) as plain_stack:
        plain = openai.OpenAI(base_url=f"http://127.0.0.1:{plain_stack.addresses.http_port}/v1", api_key="unused")
        unforced = ask(plain, QUESTION, tool_choice="required", parallel_tool_calls=False)
        assert plain_stack.info().speculation.num_verify_steps == 0
    assert [(c.function.name, c.function.arguments) for c in unforced.choices[0].message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in forced.choices[0].message.tool_calls
    ]


def test_a_langchain_agent_runs_a_two_tool_task(tools_api: openai.OpenAI) -> None:
    """An agent framework from PyPI (LangChain's ChatOpenAI.bind_tools) against the stack: each step of its plan calls
    a tool (the tool named, so the tiny model calls it), its tools run, their results go back, and it answers."""
    from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    tools = {"add": add, "multiply": multiply}
    llm = ChatOpenAI(
        model=MODEL, base_url=str(tools_api.base_url), api_key="unused", temperature=0, max_tokens=64, max_retries=0
    )
    messages: list[BaseMessage] = [HumanMessage("What is (3 + 4) * 5? Add first, then multiply, with the tools.")]
    executed = []
    for name in ("add", "multiply"):
        reply = llm.bind_tools(list(tools.values()), tool_choice=name, parallel_tool_calls=False).invoke(messages)
        messages.append(reply)
        assert [call["name"] for call in reply.tool_calls] == [name]
        for call in reply.tool_calls:
            result = tools[call["name"]].invoke(call["args"])
            executed.append((call["name"], set(call["args"]), result))
            messages.append(ToolMessage(str(result), tool_call_id=call["id"]))
    final = llm.invoke(messages)
    assert [(name, keys) for name, keys, _ in executed] == [("add", {"a", "b"}), ("multiply", {"a", "b"})]
    assert isinstance(final.content, str) and final.content and not getattr(final, "tool_calls", None)
