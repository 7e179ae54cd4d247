"""CORS (gateway/cors.py) on the real HTTP API over a socket: which origins' scripts may read answers, preflights
answered before any key is asked for, streamed answers included."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.access import ApiKeys
from gateway.config import parse_config
from gateway.cors import Cors, OriginError
from gateway.generation import Generation
from gateway.http_api import HttpApi
from gateway.metrics import GatewayMetrics
from common.text.tokenizer import Tokenizer

# The module-wide event loop, tokenizer and log set-up are the gateway server tests' fixtures.
from tests.unit.test_gateway_server import gateway, logs_to_stderr, run, text_script, tokenizer  # noqa: F401

MODEL = "SmolLM2-135M-Instruct"
APP = "https://app.example"
BODY = json.dumps({"prompt": "The capital of France is", "max_tokens": 8})


@asynccontextmanager
async def http_api(tokenizer: Tokenizer, cors: Cors, keys: ApiKeys = ApiKeys()) -> AsyncIterator[str]:
    """The HTTP API on a free port, with these origins and keys, answering "Paris."; its base URL."""
    async with gateway(tokenizer, text_script(tokenizer, " Paris.")) as harness:
        api = HttpApi(
            Generation(tokenizer, harness.client, GatewayMetrics()), harness.reporter, MODEL, keys=keys, cors=cors
        )
        runner = api.runner()
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            yield f"http://127.0.0.1:{runner.addresses[0][1]}"
        finally:
            await runner.cleanup()


async def send(method: str, url: str, headers: dict[str, str], body: str | None = None) -> tuple[int, Any, str]:
    async with aiohttp.ClientSession() as session, session.request(method, url, data=body, headers=headers) as answer:
        return answer.status, answer.headers, await answer.text()


def test_without_allowed_origins_no_answer_carries_cors_headers(run: Any, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with http_api(tokenizer, Cors()) as base:
            status, headers, _ = await send("POST", f"{base}/v1/completions", {"Origin": APP}, BODY)
            assert status == 200 and "Access-Control-Allow-Origin" not in headers
            status, headers, _ = await send(
                "OPTIONS", f"{base}/v1/completions", {"Origin": APP, "Access-Control-Request-Method": "POST"}
            )
            assert status == 405 and "Access-Control-Allow-Origin" not in headers

    run(scenario())


def test_an_allowed_origin_may_read_answers_and_preflights_come_before_the_key(run: Any, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with http_api(tokenizer, Cors.of([f"{APP}, http://localhost:3000"]), ApiKeys.of(["k"])) as base:
            preflight = {
                "Origin": APP,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            }
            status, headers, _ = await send("OPTIONS", f"{base}/v1/completions", preflight)  # no key: none is sent
            assert status == 204 and "POST" in headers["Access-Control-Allow-Methods"]
            assert "Authorization" in headers["Access-Control-Allow-Headers"]
            status, headers, _ = await send(
                "OPTIONS", f"{base}/v1/completions", {**preflight, "Origin": "https://evil.example"}
            )
            assert status == 403 and "Access-Control-Allow-Origin" not in headers
            keyed = {"Origin": APP, "Authorization": "Bearer k", "Content-Type": "application/json"}
            status, headers, _ = await send("POST", f"{base}/v1/completions", keyed, BODY)
            assert status == 200 and headers["Access-Control-Allow-Origin"] == APP and headers["Vary"] == "Origin"
            # A refusal is readable too (the page can tell its user the key is wrong), and a stream carries them.
            status, headers, _ = await send("POST", f"{base}/v1/completions", {"Origin": APP}, BODY)
            assert status == 401 and headers["Access-Control-Allow-Origin"] == APP
            streamed = json.dumps({"prompt": "Hi", "max_tokens": 4, "stream": True})
            status, headers, text = await send("POST", f"{base}/v1/completions", keyed, streamed)
            assert status == 200 and headers["Access-Control-Allow-Origin"] == APP and "[DONE]" in text
            status, headers, _ = await send(
                "POST", f"{base}/v1/completions", {**keyed, "Origin": "https://evil.example"}, BODY
            )
            assert status == 200 and "Access-Control-Allow-Origin" not in headers  # served, unreadable by that page

    run(scenario())


def test_any_origin(run: Any, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with http_api(tokenizer, Cors.of(["*"])) as base:
            status, headers, _ = await send("GET", f"{base}/health", {"Origin": "https://anywhere.example"})
            assert status == 200 and headers["Access-Control-Allow-Origin"] == "*" and "Vary" not in headers

    run(scenario())


@pytest.mark.parametrize("origin", ["app.example", "https://app.example/path", "ftp://app.example", "https://"])
def test_an_entry_that_is_not_an_origin_is_refused(origin: str, default_model_dir: Path) -> None:
    with pytest.raises(OriginError):
        Cors.of([origin])
    with pytest.raises(SystemExit):
        parse_config(["--model", str(default_model_dir), "--insecure-loopback", "--allowed-origins", origin])
