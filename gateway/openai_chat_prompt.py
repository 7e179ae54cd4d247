"""/v1/chat/completions' `messages` (and `chat_template_kwargs`) to a ChatPrompt, each message's field checked by name.

A message is its role, its text content (a string or text parts), an assistant's
`tool_calls` and a tool's `tool_call_id`; anything else is refused naming it. The chat
completions route and /tokenize read chat messages alike, so both take them from here.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.api_error import ApiError
from gateway.request import ChatPrompt
from common.text.tokenizer import RESERVED_TEMPLATE_KEYS, ChatMessage

CHAT_MESSAGE_FIELDS = frozenset({"role", "content", "tool_calls", "tool_call_id"})


def chat_prompt(body: dict[str, Any]) -> ChatPrompt:
    """/v1/chat/completions' `messages`: each with a string role and text content (a string or text parts)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages")
    return ChatPrompt(
        tuple(_chat_message(index, item) for index, item in enumerate(messages)),
        template_kwargs=_template_kwargs(body.get("chat_template_kwargs")),
    )


def _template_kwargs(value: object) -> str:
    """chat_template_kwargs (vLLM's): more variables for the chat template, as JSON text ("" for none)."""
    if value is None:
        return ""
    if not isinstance(value, dict):
        raise ApiError(400, "chat_template_kwargs must be an object of template variables", "chat_template_kwargs")
    for key in value:
        if key in RESERVED_TEMPLATE_KEYS:
            raise ApiError(
                400,
                f"chat_template_kwargs.{key}: the server sets this template variable itself",
                f"chat_template_kwargs.{key}",
            )
    return json.dumps(value, sort_keys=True) if value else ""


def _chat_message(index: int, item: object) -> ChatMessage:
    if isinstance(item, dict):
        for key in item:
            if key not in CHAT_MESSAGE_FIELDS:
                raise ApiError(
                    400,
                    f"messages[{index}].{key} is not supported by this server (a message is its role, "
                    "its content, an assistant's tool_calls and a tool's tool_call_id)",
                    f"messages[{index}].{key}",
                )
    content = item.get("content") if isinstance(item, dict) else None
    if isinstance(content, list):  # content parts: text only
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        content = "".join(t for t in texts if isinstance(t, str)) if len(texts) == len(content) else None
    calls = _message_tool_calls(index, item.get("tool_calls") if isinstance(item, dict) else None)
    if content is None and calls:  # an assistant's turn that only called tools
        content = ""
    if not isinstance(item, dict) or not isinstance(item.get("role"), str) or not isinstance(content, str):
        raise ApiError(400, f"messages[{index}] must have a string role and text content", f"messages[{index}]")
    call_id = item.get("tool_call_id")
    if call_id is not None and not isinstance(call_id, str):
        raise ApiError(400, f"messages[{index}].tool_call_id must be a string", f"messages[{index}].tool_call_id")
    return ChatMessage(role=item["role"], content=content, tool_calls=calls, tool_call_id=call_id or "")


def _message_tool_calls(index: int, calls: object) -> str:
    """An assistant message's tool_calls, checked, as JSON text ("" for none): each a function's name and its
    arguments as a JSON object's text, as OpenAI's API sends them."""
    if calls is None or calls == []:
        return ""
    field = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise ApiError(400, f"{field} must be a list of calls", field)
    checked = []
    for at, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(
                400,
                f'{field}[{at}] must be {{"type": "function", "function": {{"name": ..., "arguments": ...}}}}',
                f"{field}[{at}]",
            )
        arguments = function.get("arguments")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else None
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ApiError(
                400,
                f"{field}[{at}].function.arguments must be a JSON object's text",
                f"{field}[{at}].function.arguments",
            )
        call_id = call.get("id")
        checked.append(
            {
                "id": call_id if isinstance(call_id, str) else f"call_{at}",
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return json.dumps(checked)
