"""The `specserve generate` command: send one request to a gateway and stream its text to stdout."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

import grpc

from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc

FINISH_REASON_PREFIX = "FINISH_REASON_"


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `specserve generate`."""
    parser.add_argument("--address", default="127.0.0.1:50051", help="the gateway, HOST:PORT")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="plain text prompt, tokenized as is")
    source.add_argument("--chat", help="one user message, rendered with the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=None, help="completion tokens at most")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (the default)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus mass kept, in (0, 1]")
    parser.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens; 0 = off")
    parser.add_argument("--seed", type=int, default=None, help="same seed, same output")
    parser.add_argument("--stop", nargs="+", action="extend", default=[], metavar="STR", help="stop strings")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    parser.add_argument("--request-id", default=None, help="name the request (default: the server makes one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")


def run_generate(args: argparse.Namespace) -> int:
    """Send the request; 0 when the stream finished, 1 on a gRPC error (printed to stderr),
    2 on a bad option, 130 on Ctrl-C."""
    try:
        request = build_request(args)
    except ValueError as error:  # protobuf refuses a number out of its field's range
        print(f"error: invalid option value: {error}", file=sys.stderr)
        return 2
    with grpc.insecure_channel(args.address) as channel:
        call = pb_grpc.SpecServeStub(channel).Generate(request)
        try:
            result = consume(call, stream_to=None if args.json else sys.stdout)
        except grpc.RpcError as error:
            print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            call.cancel()  # the gateway aborts the request in the scheduler
            return 130
    if args.json:
        print(json.dumps(result.as_json(), ensure_ascii=False))
    elif sys.stdout.isatty():
        print()
    return 0


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    request = pb.GenerateRequest(params=build_params(args))
    if args.chat is not None:
        request.chat.messages.add(role="user", content=args.chat)
    else:
        request.prompt = args.prompt
    if args.request_id is not None:
        request.request_id = args.request_id
    return request


def build_params(args: argparse.Namespace) -> pb.SamplingParams:
    """Only the options given are set, so the server's defaults apply to the rest."""
    optional = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
    }
    given = {name: value for name, value in optional.items() if value is not None}
    return pb.SamplingParams(stop=args.stop, ignore_eos=args.ignore_eos, **given)


@dataclass
class GenerateResult:
    request_id: str = ""
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "unspecified"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    verify_steps: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache held

    def as_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "text": "".join(self.text_parts),
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "draft_tokens": self.draft_tokens,
                "accepted_draft_tokens": self.accepted_draft_tokens,
                "verify_steps": self.verify_steps,
                "cached_tokens": self.cached_tokens,
            },
        }


def consume(responses: Iterable[pb.GenerateResponse], stream_to: TextIO | None) -> GenerateResult:
    """Gather the stream; with stream_to, write each text delta there as it arrives."""
    result = GenerateResult()
    for response in responses:
        result.request_id = response.request_id
        result.text_parts.append(response.text)
        result.token_ids.extend(response.token_ids)
        if stream_to is not None and response.text:
            stream_to.write(response.text)
            stream_to.flush()
        if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            result.finish_reason = finish_reason_name(response.finish_reason)
            result.prompt_tokens = response.usage.prompt_tokens
            result.completion_tokens = response.usage.completion_tokens
            result.draft_tokens = response.usage.draft_tokens
            result.accepted_draft_tokens = response.usage.accepted_draft_tokens
            result.verify_steps = response.usage.verify_steps
            result.cached_tokens = response.usage.cached_tokens
    return result


def finish_reason_name(value: int) -> str:
    """FINISH_REASON_STOP -> "stop"."""
    return pb.FinishReason.Name(value).removeprefix(FINISH_REASON_PREFIX).lower()
