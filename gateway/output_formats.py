"""The names of the formats a gateway reads a model's answers in: a thinking model's reasoning (gateway/reasoning.py)
and its tool calls (gateway/tools.py). Light, since `specserve up` imports it for its flags."""

from __future__ import annotations

from typing import Literal

REASONING_PARSERS = ("qwen3", "deepseek_r1")
ReasoningParser = Literal["qwen3", "deepseek_r1"]
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
ToolCallParser = Literal["hermes", "llama3_json"]
