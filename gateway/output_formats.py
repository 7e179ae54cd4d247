"""The names of the formats a gateway reads a model's answers in: a thinking model's reasoning (gateway/reasoning.py)
and its tool calls (gateway/tools.py). Their choices as flags are in the settings table (common/settings/edge.py)."""

from __future__ import annotations

from typing import Literal

ReasoningParser = Literal["qwen3", "deepseek_r1"]
ToolCallParser = Literal["hermes", "llama3_json"]
