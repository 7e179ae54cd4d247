"""The names of the formats a gateway reads a model's answers in: a thinking model's reasoning (gateway/reasoning.py)
and its tool calls (gateway/tools.py). Light, since `specserve up` imports it for its flags."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

REASONING_PARSERS = ("qwen3", "deepseek_r1")
ReasoningParser = Literal["qwen3", "deepseek_r1"]
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
ToolCallParser = Literal["hermes", "llama3_json"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's flags for how chat answers are read and prompts rendered (`specserve up` passes them on)."""
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                        help="a thinking model's convention: its reasoning between <think> and </think> goes to chat "
                             "answers' reasoning_content, the rest to content (qwen3: the model opens the tag; "
                             "deepseek_r1: the template does)")
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                        help="the format the model writes tool calls in (hermes: <tool_call> JSON, as Qwen 2.5 and 3; "
                             "llama3_json: Llama 3's JSON); without it, chat requests with tools are refused")
    parser.add_argument("--chat-template", type=Path, default=None,
                        help="a Jinja chat template file to render chat messages with, in place of the model's own")
