"""The gateway's public edges refuse what a client can get wrong with a 4xx and a JSON error (HTTP) or
INVALID_ARGUMENT (gRPC), never a 500 or a hang, and go on serving: each test is one observed failure."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import grpc
import pytest
from aiohttp import web

from gateway.api_error import ApiError
from gateway.config import parse_config
from gateway.generation import Generation
from gateway.http_api import HttpApi
from gateway.http_body import BodyLimits, check_depth, check_text
from gateway.metrics import GatewayMetrics
from gateway.validation import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from common.text.tokenizer import Tokenizer
from proto import specserve_pb2 as pb

# The module-wide event loop, tokenizer and log set-up are the gateway server tests' fixtures.
from tests.unit.test_gateway_server import Harness, collect, gateway, logs_to_stderr, run, text_script, tokenizer  # noqa: F401

T = TypeVar("T")
MODEL = "SmolLM2-135M-Instruct"


@asynccontextmanager
async def http_gateway(tokenizer: Tokenizer, limits: BodyLimits = BodyLimits()) -> AsyncIterator[tuple[Harness, int]]:
    """The gRPC harness with the HTTP API beside it on a free port, both answering "Paris."."""
    async with gateway(tokenizer, text_script(tokenizer, " Paris.")) as harness:
        api = HttpApi(Generation(tokenizer, harness.client, GatewayMetrics()), harness.reporter, MODEL, limits)
        runner = api.runner()
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            yield harness, int(runner.addresses[0][1])
        finally:
            await runner.cleanup()


async def post(port: int, path: str, body: bytes | str, content_type: str = "application/json") -> tuple[int, Any]:
    """Status and JSON body (the test fails on any other body)."""
    data = body.encode() if isinstance(body, str) else body
    url, headers = f"http://127.0.0.1:{port}{path}", {"Content-Type": content_type}
    async with aiohttp.ClientSession() as session, session.post(url, data=data, headers=headers) as response:
        return response.status, json.loads(await response.read())


async def assert_still_serves(port: int) -> None:
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 8})
    status, body = await post(port, "/v1/completions", body)
    assert status == 200 and body["choices"][0]["text"] == " Paris."


def assert_error(status: int, body: Any, expected_status: int, param: str | None = None) -> str:
    assert status == expected_status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param
    message: str = body["error"]["message"]
    return message


# ---------------------------------------------------------------------------------------------------- HTTP

SURROGATE_BODIES = [
    ("/v1/completions", r'{"prompt": "a\ud800b"}', "prompt"),
    ("/v1/completions", r'{"prompt": "hi", "stop": ["x", "\udfff"]}', "stop[1]"),
    ("/v1/completions", r'{"prompt": "hi", "user": "\ud83d"}', "user"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages[0].content"),
    (
        "/v1/chat/completions",
        r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
        "messages[0].content[0].text",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_BODIES)
def test_a_lone_surrogate_anywhere_is_400_naming_the_field(
    run: Any, tokenizer: Tokenizer, path: str, body: str, param: str
) -> None:
    async def scenario() -> None:
        async with http_gateway(tokenizer) as (_, port):
            message = assert_error(*await post(port, path, body), 400, param)
            assert "surrogate" in message
            await assert_still_serves(port)

    run(scenario())


def test_a_surrogate_pair_is_a_character(run: Any, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with http_gateway(tokenizer) as (_, port):
            status, _ = await post(port, "/v1/completions", r'{"prompt": "\ud83d\ude00", "max_tokens": 4}')
            assert status == 200

    run(scenario())


def test_an_unknown_charset_is_415_and_a_known_one_is_used(run: Any, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with http_gateway(tokenizer) as (_, port):
            body = json.dumps({"prompt": "hi"})
            for charset in ("klingon", "rot13"):
                content_type = f"application/json; charset={charset}"
                message = assert_error(*await post(port, "/v1/completions", body, content_type), 415)
                assert charset in message
            latin = json.dumps({"prompt": "café", "max_tokens": 4}, ensure_ascii=False).encode("latin-1")
            status, _ = await post(port, "/v1/completions", latin, "application/json; charset=latin-1")
            assert status == 200
            assert_error(*await post(port, "/v1/completions", b'{"prompt": "\xff"}'), 400)  # not UTF-8
            await assert_still_serves(port)

    run(scenario())


def test_deep_json_is_400_naming_the_limit_without_recursing(run: Any, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with http_gateway(tokenizer) as (_, port):
            deep = '{"prompt": "hi", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
            message = assert_error(*await post(port, "/v1/completions", deep), 400)
            assert "deeper than 64" in message
            await assert_still_serves(port)

    run(scenario())


def test_nesting_is_counted_outside_strings_only() -> None:
    check_depth(json.dumps({"prompt": "[[[[" * 100 + '\\"[{'}), 2)  # brackets in a string, escapes too
    check_depth("[" * 64 + "]" * 64, 64)
    with pytest.raises(ApiError, match="deeper than 64"):
        check_depth("[" * 65 + "]" * 65, 64)
    with pytest.raises(ApiError, match="deeper than 3"):
        check_depth('{"a": "]]]", "b": [{"c": [[1]]}]}', 3)


def test_a_surrogate_is_named_in_a_long_array_and_past_the_walk_by_its_top_level_key() -> None:
    with pytest.raises(ApiError) as failure:
        check_text({"prompt": [1] * 100_000 + ["ok", "\ud800"]})
    assert failure.value.param == "prompt[100001]"
    with pytest.raises(ApiError) as failure:
        check_text({"model": "m", "messages": [{"role": "user"}] * 20_000 + [{"content": "\udfff"}]})
    assert failure.value.param == "messages"  # past the walk's budget of containers
    check_text({"prompt": [1] * 100_000 + ["\U0001f600"], "stop": ["\U0001f600"]})


def test_a_body_over_the_size_limit_is_413(run: Any, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with http_gateway(tokenizer, BodyLimits(max_body_bytes=1000)) as (_, port):
            message = assert_error(*await post(port, "/v1/completions", json.dumps({"prompt": "x" * 2000})), 413)
            assert "1000 bytes" in message
            await assert_still_serves(port)

    run(scenario())


def test_a_body_that_never_arrives_is_408_and_others_are_served_meanwhile(run: Any, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with http_gateway(tokenizer, BodyLimits(read_timeout_s=0.5)) as (_, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n" + b'{"prompt": '
            )  # 11 of the 100 bytes, then nothing
            await writer.drain()
            await assert_still_serves(port)  # while that one waits
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 408")
            assert b"Connection: close" in head
            length = int(
                next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")).split(b":")[1]
            )
            body = json.loads(await reader.readexactly(length))
            assert body["error"]["code"] == "body_timeout" and "0.5 s" in body["error"]["message"]
            writer.close()
            await assert_still_serves(port)

    run(scenario())


def test_headers_that_never_end_close_the_connection_after_the_read_timeout(run: Any, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with http_gateway(tokenizer, BodyLimits(read_timeout_s=0.5)) as (_, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and no end of the headers
            await writer.drain()
            await assert_still_serves(port)
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, no answer
            writer.close()
            await assert_still_serves(port)

    run(scenario())


def test_stop_strings_are_bounded_in_number_and_length_over_http(run: Any, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with http_gateway(tokenizer) as (_, port):
            too_many = json.dumps({"prompt": "hi", "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]})
            message = assert_error(*await post(port, "/v1/completions", too_many), 400, "stop")
            assert f"at most {MAX_STOP_STRINGS}" in message
            too_long = json.dumps({"prompt": "hi", "stop": ["ok", "x" * (MAX_STOP_STRING_CHARS + 1)]})
            assert_error(*await post(port, "/v1/completions", too_long), 400, "stop[1]")
            at_the_limits = {
                "prompt": "The capital of France is",
                "max_tokens": 8,
                "stop": ["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
            }
            status, body = await post(port, "/v1/completions", json.dumps(at_the_limits))
            assert status == 200 and body["choices"][0]["text"] == " Paris."

    run(scenario())


def test_the_http_limits_are_set_and_checked_on_the_command_line(default_model_dir: Path) -> None:
    config = parse_config(
        [
            "--model",
            str(default_model_dir),
            "--http-max-body-bytes",
            "1024",
            "--http-read-timeout-s",
            "2.5",
            "--insecure-loopback",
        ]
    )
    assert (config.http_max_body_bytes, config.http_read_timeout_s) == (1024, 2.5)
    for flag in ("--http-max-body-bytes", "--http-read-timeout-s"):
        with pytest.raises(SystemExit):
            parse_config(["--model", str(default_model_dir), flag, "0", "--insecure-loopback"])


# ---------------------------------------------------------------------------------------------------- gRPC

UNDECODABLE = [b"\xff", b"\x0a\x10short"]  # a bad tag, a length past the end


@pytest.mark.parametrize("raw", [*UNDECODABLE, b"\x0a\x02\xff\xfe"], ids=["bad-tag", "truncated", "bad-utf8-prompt"])
def test_undecodable_generate_requests_are_invalid_argument(run: Any, tokenizer: Tokenizer, raw: bytes) -> None:
    async def scenario() -> None:
        async with gateway(tokenizer, text_script(tokenizer, " Paris.")) as harness:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{harness.port}") as channel:
                generate = channel.unary_stream(
                    "/specserve.v1.SpecServe/Generate", response_deserializer=pb.GenerateResponse.FromString
                )
                with pytest.raises(grpc.aio.AioRpcError) as failure:
                    await collect(generate(raw))
            assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid specserve.v1.GenerateRequest" in (failure.value.details() or "")
            responses = await collect(harness.stub.Generate(pb.GenerateRequest(prompt="The capital of France is")))
            assert "".join(r.text for r in responses) == " Paris."

    run(scenario())


@pytest.mark.parametrize("raw", UNDECODABLE, ids=["bad-tag", "truncated"])
def test_undecodable_server_info_requests_are_invalid_argument(run: Any, tokenizer: Tokenizer, raw: bytes) -> None:
    async def scenario() -> None:
        async with gateway(tokenizer, text_script(tokenizer, " Paris.")) as harness:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{harness.port}") as channel:
                info = channel.unary_unary(
                    "/specserve.v1.SpecServe/GetServerInfo", response_deserializer=pb.ServerInfoResponse.FromString
                )
                with pytest.raises(grpc.aio.AioRpcError) as failure:
                    await info(raw)
            assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid specserve.v1.ServerInfoRequest" in (failure.value.details() or "")
            assert (await harness.stub.GetServerInfo(pb.ServerInfoRequest())).model_name == MODEL

    run(scenario())


def test_stop_strings_are_bounded_over_grpc(run: Any, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with gateway(tokenizer, text_script(tokenizer, " Paris.")) as harness:
            for stop, field in (
                ([f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], "params.stop"),
                (["ok", "x" * (MAX_STOP_STRING_CHARS + 1)], "params.stop[1]"),
            ):
                request = pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(stop=stop))
                with pytest.raises(grpc.aio.AioRpcError) as failure:
                    await collect(harness.stub.Generate(request))
                assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert (failure.value.details() or "").startswith(f"{field}: ")
            assert not harness.scheduler.submits()

    run(scenario())
