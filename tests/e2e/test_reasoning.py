"""A thinking model's reasoning apart from its answer through the stack (`--reasoning-parser`): a gateway with the
qwen3 convention beside the stack's own, and the embedded model made to write a `<think>` block by a regex (structured
output), so that the split is of tokens the model really generated, whole and streamed, through the openai SDK."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

import openai

from specserve.health_probes import is_serving
from specserve.stack import free_ports, gateway_spec
from tests.e2e.stack import Stack

MODEL = "SmolLM2-135M-Instruct"
THINKING = r"<think>[a-z ]{4,24}</think>[A-Z][a-z ]{3,24}\."


def start_gateway(stack: Stack, name: str, *args: str) -> int:
    """A gateway beside the stack's own with `args`; its HTTP port once it serves."""
    grpc_port, http_port = free_ports(2, taken=(stack.addresses.grpc_port, stack.addresses.http_port))
    spec = gateway_spec(stack.config, replace(stack.addresses, grpc_port=grpc_port, http_port=http_port))
    stack.spawn(replace(spec, name=name, argv=[*spec.argv, *args]))
    deadline = time.monotonic() + 60
    while not is_serving(stack.addresses.host, grpc_port):
        assert time.monotonic() < deadline, (stack.log_dir / f"{name}.log").read_text()[-3000:]
        time.sleep(0.2)
    return http_port


def test_the_reasoning_goes_to_reasoning_content_whole_and_streamed(fp32_stack: Stack) -> None:
    port = start_gateway(fp32_stack, "gateway-reasoning", "--reasoning-parser", "qwen3")
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    ask: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Think, then answer: is ice cold?"}],
        max_tokens=80,
        temperature=0,
        extra_body={"guided_regex": THINKING},
    )
    whole = api.chat.completions.create(**ask)
    message = whole.choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning_content")
    assert isinstance(reasoning, str) and reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert message.content and message.content[0].isupper() and "think>" not in message.content
    # The same request through the stack's own gateway (no parser): the tags and both parts, as generated.
    plain = openai.OpenAI(base_url=f"http://127.0.0.1:{fp32_stack.addresses.http_port}/v1", api_key="unused")
    assert (
        plain.chat.completions.create(**ask).choices[0].message.content
        == f"<think>{reasoning}</think>{message.content}"
    )
    pieces = {"reasoning_content": "", "content": ""}
    for event in api.chat.completions.create(**ask, stream=True):
        delta = json.loads(event.choices[0].delta.model_dump_json()) if event.choices else {}
        for key in pieces:
            pieces[key] += delta.get(key) or ""
    assert pieces == {"reasoning_content": reasoning, "content": message.content}
