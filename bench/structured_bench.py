"""Structured output benchmark: tok/s with and without a JSON schema, with and without speculation, at c = 1 and 8.

Each configuration is a `specserve up` stack (by default: `--draft none --num-speculative-tokens
0`, no speculation at all, against up's defaults, which speculate with the default draft and
verify the tokens a grammar forces). For each, every schema's prompt is sent `--repeat`
times, greedy, one at a time (c = 1) and then eight at once (c = 8), with the schema and
without one (the same prompts, free text, the same max_tokens). It reports completion
tokens per second, the draft tokens proposed and accepted, and whether every structured
answer parsed and validated. Ratios are measured in one run on the same machine.

    python bench/structured_bench.py [--config "--draft none --num-speculative-tokens 0" --config ""]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import jsonschema

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine_info import describe_machine
from bench.local_stack import running_up
from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 30},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "status": {"type": "string", "enum": ["new", "paid", "shipped"]},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 8},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "quantity"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["id", "status", "items"],
        "additionalProperties": False,
    },
    "profile": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "handle": {"type": "string", "maxLength": 12},
                    "favourite_colours": {"type": "array", "maxItems": 3, "items": {"enum": ["red", "green", "blue"]}},
                },
                "required": ["handle", "favourite_colours"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
            "member_since": {"type": "integer", "minimum": 1990, "maximum": 2030},
        },
        "required": ["user", "active", "member_since"],
        "additionalProperties": False,
    },
}
PROMPTS = {
    "person": "Describe a person called Ada, aged 36, as JSON.",
    "order": "Write an order for two apples and a pear as JSON.",
    "profile": "Make up a user profile as JSON.",
}
MAX_TOKENS = 120


def request(name: str, structured: bool) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    if structured:
        params.structured_output.json_schema = json.dumps(SCHEMAS[name])
    return pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=PROMPTS[name])]), params=params
    )


async def run_one(stub: pb_grpc.SpecServeStub, name: str, structured: bool) -> tuple[int, int, int, bool]:
    text, last = [], None
    async for response in stub.Generate(request(name, structured), timeout=600):
        text.append(response.text)
        last = response
    assert last is not None
    valid = True
    if structured:
        try:
            jsonschema.validate(json.loads("".join(text)), SCHEMAS[name])
        except (ValueError, jsonschema.ValidationError):
            valid = False
    usage = last.usage
    return usage.completion_tokens, usage.draft_tokens, usage.accepted_draft_tokens, valid


async def workload(address: str, structured: bool, concurrency: int, repeat: int) -> dict[str, Any]:
    names = [name for name in SCHEMAS for _ in range(repeat)]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.SpecServeStub(channel)
        await run_one(stub, names[0], structured)  # warm: the worker's grammar tokenizer, the prefix cache
        started = time.perf_counter()
        results: list[tuple[int, int, int, bool]] = []
        for first in range(0, len(names), concurrency):
            batch = names[first : first + concurrency]
            results += await asyncio.gather(*(run_one(stub, name, structured) for name in batch))
        duration = time.perf_counter() - started
    tokens = sum(r[0] for r in results)
    return {
        "structured": structured,
        "concurrency": concurrency,
        "num_requests": len(results),
        "completion_tokens": tokens,
        "duration_s": round(duration, 2),
        "tokens_per_s": round(tokens / duration, 1),
        "draft_tokens": sum(r[1] for r in results),
        "accepted_draft_tokens": sum(r[2] for r in results),
        "all_valid": all(r[3] for r in results),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config", action="append", default=None, help="`specserve up` flags for one configuration (repeatable)"
    )
    parser.add_argument("--repeat", type=int, default=8, help="requests per schema and workload")
    parser.add_argument("--output", type=Path, default=None, help="write the results here as JSON")
    args = parser.parse_args()
    configs = args.config or ["--draft none --num-speculative-tokens 0", ""]
    report: dict[str, Any] = {"machine": None, "runs": []}
    for config in configs:
        with running_up(shlex.split(config)) as stack:
            report["machine"] = describe_machine(stack.dtype, stack.device)
            print(f"# {stack.ready_line}", flush=True)
            for concurrency in (1, 8):
                for structured in (False, True):
                    result = {
                        "config": config or "(up's defaults)",
                        **asyncio.run(workload(stack.address, structured, concurrency, args.repeat)),
                    }
                    report["runs"].append(result)
                    print(json.dumps(result), flush=True)
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
