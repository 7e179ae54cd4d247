"""Tool calling, as OpenAI's chat API defines it: `tools`, `tool_choice`, `parallel_tool_calls` in, and
`message.tool_calls` with `finish_reason: "tool_calls"` out.

The tools are rendered into the prompt by the model's chat template, so a template that takes
no `tools` variable is refused (400), as is a gateway started without `--tool-call-parser`,
which names the format the model writes its calls in:

- `hermes` (Qwen 2.5 and 3, Hermes, and most ChatML models trained for tools): each call a JSON
  object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, text
  around them being the message's content; a block that is not such a call to a tool offered
  (bad JSON, an unknown name, a tag left unclosed) stays in the content as text;
- `llama3_json` (Llama 3.1-3.3): the answer is the call, a JSON object `{"name": ...,
  "parameters": {...}}` (several separated by `; `), after an optional `<|python_tag|>`.

With `tool_choice` `auto` the model chooses, and the answer is read with the parser: what is
not a well-formed call to one of the tools offered (an unclosed tag, bad JSON, an unknown
name) stays text. With `required`, or a function named, the answer is constrained by a grammar
made from the tools' JSON Schemas (llguidance), in the parser's own format, so it always
parses (unless max_tokens cuts it short: then it is text, with finish_reason `length`); its
forced tokens are verified as drafts, as structured output's are. `none` renders no tools.

Streamed (`CallGate`), text goes out as content until a call may begin; a Hermes call goes
out as soon as its block closes (a chunk with its id and name, then one with its arguments,
as OpenAI's stream sends them), a Llama 3 answer's calls when it ends.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.api_error import ApiError
from gateway.output_formats import ToolCallParser
from gateway.reasoning import partial_suffix

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names
_HERMES_OPEN = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolAsk:
    """What a request asks of tools: the tools (as sent), which to call, and whether several at once."""

    tools: tuple[dict[str, Any], ...]
    choice: str  # "auto", "required", or the name of the one function to call
    parallel: bool

    @property
    def names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools]

    @property
    def constrained(self) -> bool:
        """Whether the answer is a call for certain (a grammar makes it one)."""
        return self.choice != "auto"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def tool_ask(body: dict[str, Any]) -> ToolAsk | None:
    """The body's tools, tool_choice and parallel_tool_calls checked; None when it offers none to call (no tools, or
    tool_choice "none"). Raises ApiError naming the field."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ApiError(400, f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    checked = tuple(_tool(index, tool) for index, tool in enumerate(tools))
    names = [tool["function"]["name"] for tool in checked]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: each function must have a name of its own", "tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ApiError(
                400,
                'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if name not in names:
            raise ApiError(
                400, f"tool_choice names {name!r}, which is not one of the tools", "tool_choice.function.name"
            )
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise ApiError(
            400,
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if choice == "none":
        return None
    return ToolAsk(checked, choice, parallel is not False)


def _tool(index: int, tool: object) -> dict[str, Any]:
    field = f"tools[{index}]"
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
        raise ApiError(
            400, f'{field} must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}', field
        )
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ApiError(400, f"{field}.function.name must be 1 to 64 letters, digits, _ or -", f"{field}.function.name")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise ApiError(400, f"{field}.function.parameters must be a JSON Schema object", f"{field}.function.parameters")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ApiError(400, f"{field}.function.description must be a string", f"{field}.function.description")
    checked: dict[str, Any] = {"name": name, "parameters": parameters}
    if description is not None:
        checked["description"] = description
    return {"type": "function", "function": checked}


def call_grammar(ask: ToolAsk, parser: ToolCallParser) -> str:
    """llguidance's Lark grammar of an answer that is one call (or, with parallel calls, several) to the tool named,
    or any of them, in the parser's format."""
    arguments_key = "arguments" if parser == "hermes" else "parameters"
    chosen = [
        tool["function"] for tool in ask.tools if ask.choice == "required" or tool["function"]["name"] == ask.choice
    ]
    call_schema = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, arguments_key: f["parameters"]},
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
            for f in chosen
        ]
    }
    body = "call: %json " + json.dumps(call_schema)
    if parser == "hermes":
        one = '"<tool_call>\\n" call "\\n</tool_call>"'
        start = f"start: {one}" + (f' ("\\n" {one})*' if ask.parallel else "")
    else:
        start = "start: call" + ('("; " call)*' if ask.parallel else "")
    return f"{start}\n{body}\n"


def parse_calls(parser: ToolCallParser, text: str, ask: ToolAsk) -> tuple[str | None, list[ToolCall]]:
    """The answer's content (None when nothing is left) and its calls, read as the parser's format says; an answer
    that is not well-formed calls to the tools offered is all content, never an error."""
    if parser == "hermes":
        content, calls = _hermes(text, ask)
        return content.strip() or None, calls
    read = _llama3(text, ask)
    if read is None:
        return text, []
    return None, read if ask.parallel else read[:1]


def _hermes(text: str, ask: ToolAsk) -> tuple[str, list[ToolCall]]:
    """The text without the blocks that are calls, and those calls: without parallel calls, the first only (the
    others' blocks taken out all the same)."""
    content: list[str] = []
    calls: list[ToolCall] = []
    at = 0
    for block in _HERMES_CALL.finditer(text):
        call = _call(block.group(1), ask, "arguments")
        content.append(text[at : block.start()] if call is not None else text[at : block.end()])
        at = block.end()
        if call is not None and (ask.parallel or not calls):
            calls.append(call)
    content.append(text[at:])
    return "".join(content), calls


def _llama3(text: str, ask: ToolAsk) -> list[ToolCall] | None:
    stripped = text.strip()
    stripped = stripped[len(_PYTHON_TAG) :].strip() if stripped.startswith(_PYTHON_TAG) else stripped
    if not stripped.startswith("{"):
        return None
    decoder, calls, rest = json.JSONDecoder(), [], stripped
    while rest:  # calls separated by ";" (one may close the answer)
        try:
            value, end = decoder.raw_decode(rest)
        except ValueError:
            return None
        if (call := _call_of(value, ask, "parameters")) is None:
            return None
        calls.append(call)
        rest = rest[end:].lstrip()
        if rest and not rest.startswith(";"):
            return None
        rest = rest[1:].lstrip()
    return calls


def _call(body: str, ask: ToolAsk, arguments_key: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return _call_of(value, ask, arguments_key)


def _call_of(value: object, ask: ToolAsk, arguments_key: str) -> ToolCall | None:
    if not isinstance(value, dict) or value.get("name") not in ask.names:
        return None
    arguments = value.get(arguments_key, value.get("arguments" if arguments_key == "parameters" else "parameters"))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(str(value["name"]), json.dumps(arguments, ensure_ascii=False))


class CallGate:
    """A streamed answer's text: what may go out as content at once, and the calls as soon as they are known.

    Hermes: text goes out until `<tool_call>` (a piece that may be its start is held until the next says); a block
    goes out as a call when it closes and is one (else as text), so the stream says what `parse_calls` reads from
    the whole answer. Llama 3: an answer that begins with `{` or `<|python_tag|>` is calls, held whole until it ends
    (`finish`). A forced answer is calls from its start."""

    def __init__(self, parser: ToolCallParser, ask: ToolAsk) -> None:
        self.parser = parser
        self.ask = ask
        self.held = ""  # from the first place a call may begin
        self.num_calls = 0  # calls let go so far
        self._streamed_any = False
        # Hermes: inside a block (a forced answer opens one at once); Llama 3: the answer is calls.
        self._in_call = ask.constrained and parser != "hermes"

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content and the calls this piece lets go now."""
        if self.parser == "hermes":
            return self._hermes(self.held + text)
        if self._in_call:
            self.held += text
            return "", []
        pending = self.held + text
        self.held = ""
        if not self._streamed_any:
            stripped = pending.lstrip()
            if stripped.startswith(("{", _PYTHON_TAG)):
                self._in_call = True
                self.held = pending
                return "", []
            if not stripped or _PYTHON_TAG.startswith(stripped):  # white space, or the tag begun: wait for more
                self.held = pending
                return "", []
        return self._out(pending), []

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content and the calls left when the answer ends."""
        held, self.held = self.held, ""
        if self.parser == "hermes":
            return held, []  # a block left open, or what may have begun one: text
        content, calls = parse_calls(self.parser, held, self.ask)
        self.num_calls += len(calls)
        return content or "", calls

    def _hermes(self, pending: str) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_call:
                block = _HERMES_CALL.match(pending)
                if block is None:  # not closed yet
                    self.held = pending
                    return self._out("".join(content)), calls
                self._in_call = False
                call = _call(block.group(1), self.ask, "arguments")
                if call is None:
                    content.append(block.group(0))
                elif self.ask.parallel or self.num_calls == 0:
                    calls.append(call)
                    self.num_calls += 1
                pending = pending[block.end() :]
            at = pending.find(_HERMES_OPEN)
            if at < 0:
                keep = partial_suffix(pending, _HERMES_OPEN)
                self.held = pending[len(pending) - keep :]
                content.append(pending[: len(pending) - keep])
                return self._out("".join(content)), calls
            content.append(pending[:at])
            self._in_call = True
            pending = pending[at:]

    def _out(self, text: str) -> str:
        self._streamed_any = self._streamed_any or bool(text)
        return text
