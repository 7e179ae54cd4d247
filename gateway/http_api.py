"""The OpenAI-compatible HTTP API (aiohttp on the gateway's uvloop), on the same path to the scheduler as gRPC.

Routes: POST /v1/completions, POST /v1/chat/completions (streaming as server-sent events
ending with `data: [DONE]`, or one JSON body), GET /v1/models, GET /health (the gateway is
alive), GET /ready (200 only while a target worker is READY), GET /metrics (Prometheus).

A request body becomes a ClientRequest (openai_request.py) checked by the same `validate`
as gRPC's, so both APIs accept and refuse the same things; errors come back in OpenAI's
format with the matching HTTP status, the offending field, named as in the body, in `param`.
A body is read within BodyLimits (http_body.py): its size, the time it takes to arrive, its
charset, how deep it nests and whether its text is valid Unicode.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from common.logs import get_logger
from gateway.errors import RequestFailed
from gateway.generation import Generation
from gateway.health import SERVING, HealthReporter
from gateway.http_body import BodyLimits, json_body
from gateway.openai_request import ApiError, chat_prompt, client_request_of, completion_prompt
from gateway.output import Chunk
from gateway.request import Prompt, Submission
from gateway.validation import validate


class HttpApi:
    def __init__(self, generation: Generation, reporter: HealthReporter, model_name: str,
                 limits: BodyLimits = BodyLimits()) -> None:
        self._generation = generation
        self._limits = limits
        self._reporter = reporter
        self._model_name = model_name
        self._created = int(time.time())
        self.draining = False  # after the first SIGTERM: new generation requests get 503
        self._num_generating = 0  # generation requests in flight
        self._idle = asyncio.Event()  # set while none is
        self._idle.set()
        self._log = get_logger(component="http_api")

    async def wait_idle(self) -> None:
        """Return once no generation request is in flight (for draining)."""
        await self._idle.wait()

    def runner(self) -> web.AppRunner:
        """The application ready to set up and bind. Its keep-alive timer runs from the connection's start (and from
        each response) until a request's headers are all in: the read timeout bounds headers sent slowly too."""
        return web.AppRunner(self.application(), handler_cancellation=True, access_log=None,
                             keepalive_timeout=self._limits.read_timeout_s)

    def application(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=self._limits.max_body_bytes)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as error:
            return error_response(error)
        except RequestFailed as failure:  # an InvalidArgument names the body's field (checked with OPENAI_FIELDS)
            return error_response(ApiError.from_failure(failure))
        except web.HTTPException as error:  # unknown route, wrong method
            return error_response(ApiError(error.status, error.reason or "not found"))
        except ConnectionResetError:  # the client is gone: there is no one to answer
            raise
        except Exception as error:  # recoverable: this request fails (as JSON, like every error), the gateway lives on
            self._log.exception("request.internal_error", error_type=type(error).__name__)
            return error_response(ApiError(500, f"internal error in the gateway: {type(error).__name__}"))

    # ------------------------------------------------------------------ the simple routes

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self._model_name, "object": "model", "created": self._created, "owned_by": "specserve"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        if self._reporter.status == SERVING:
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "not ready: no target worker is READY"}, status=503)

    async def metrics(self, request: web.Request) -> web.Response:
        try:
            info = await self._generation.scheduler.query_info()
        except RequestFailed:
            info = None
        body = self._generation.metrics.exposition(info, self._generation.scheduler.protocol_errors.counts)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # ------------------------------------------------------------------ generation

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await json_body(request, self._limits)
        return await self._run(request, body, completion_prompt(body), chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await json_body(request, self._limits)
        return await self._run(request, body, chat_prompt(body), chat=True)

    async def _run(self, request: web.Request, body: dict[str, Any], prompt: Prompt, *, chat: bool) -> web.StreamResponse:
        if self.draining:
            raise ApiError(503, "the server is shutting down")
        self._num_generating += 1
        self._idle.clear()
        try:
            return await self._generate(request, body, prompt, chat=chat)
        finally:
            self._num_generating -= 1
            if not self._num_generating:
                self._idle.set()

    async def _generate(self, request: web.Request, body: dict[str, Any], prompt: Prompt, *,
                        chat: bool) -> web.StreamResponse:
        model = body.get("model")
        if model is not None and model != self._model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self._model_name!r}", "model",
                           "model_not_found")
        client_request, fields = client_request_of(body, prompt, chat=chat)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        submission = validate(client_request, fields=fields, request_id=request_id,
                              vocab_size=self._generation.tokenizer.vocab_size)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "stream must be a boolean", "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object", "stream_options")
        shape = _Shape(request_id, self._model_name, chat)
        if stream:
            return await self._stream(request, submission, shape, bool(options.get("include_usage", False)))
        return await self._whole(submission, shape)

    async def _whole(self, submission: Submission, shape: _Shape) -> web.Response:
        text: list[str] = []
        last: Chunk | None = None
        async with contextlib.aclosing(self._generation.chunks(submission, "http")) as chunks:
            async for chunk in chunks:
                text.append(chunk.text)
                last = chunk
        assert last is not None  # the generation always ends with a finishing chunk
        return web.json_response(shape.whole("".join(text), last))

    async def _stream(self, request: web.Request, submission: Submission, shape: _Shape, include_usage: bool) -> web.StreamResponse:
        chunks = self._generation.chunks(submission, "http")
        async with contextlib.aclosing(chunks):
            # Pull the first chunk before answering 200, so an early failure (bad prompt, queue full, no worker)
            # is still an ordinary error response.
            first = await anext(chunks)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            try:
                if shape.chat:
                    await _send_event(response, shape.delta_event({"role": "assistant", "content": ""}, None))
                chunk = first
                while True:
                    await _send_event(response, shape.stream_event(chunk))
                    if chunk.finish_reason is not None:
                        break
                    chunk = await anext(chunks)
                if include_usage:
                    await _send_event(response, shape.usage_event(chunk))
                await response.write(b"data: [DONE]\n\n")
            except RequestFailed as failure:  # after the 200: report it in the stream, as OpenAI does
                await _send_event(response, {"error": {"message": failure.message, "code": failure.status.name}})
            except ConnectionResetError:
                self._log.info("request.client_gone", request_id=shape.request_id)  # aclosing aborts the request
                raise
        await response.write_eof()
        return response


class _Shape:
    """How OpenAI's responses look for one request."""

    def __init__(self, request_id: str, model: str, chat: bool) -> None:
        self.request_id, self.model, self.chat = request_id, model, chat
        self.created = int(time.time())

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, last: Chunk) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": last.finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": last.finish_reason, "logprobs": None}
        return {**self._envelope("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": _usage(last)}

    def delta_event(self, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        return {**self._envelope("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}

    def stream_event(self, chunk: Chunk) -> dict[str, Any]:
        if self.chat:
            return self.delta_event({"content": chunk.text} if chunk.text else {}, chunk.finish_reason)
        return {**self._envelope("text_completion"),
                "choices": [{"index": 0, "text": chunk.text, "finish_reason": chunk.finish_reason, "logprobs": None}]}

    def usage_event(self, last: Chunk) -> dict[str, Any]:
        return {**self._envelope("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": _usage(last)}


def _usage(last: Chunk) -> dict[str, Any]:
    return {"prompt_tokens": last.num_prompt_tokens, "completion_tokens": last.num_completion_tokens,
            "total_tokens": last.num_prompt_tokens + last.num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": last.num_cached_tokens},
            "speculation": {"draft_tokens": last.speculation.num_draft_tokens,
                            "accepted_draft_tokens": last.speculation.num_accepted_draft_tokens,
                            "verify_steps": last.speculation.num_verify_steps}}


def error_response(error: ApiError) -> web.Response:
    response = web.json_response(error.body(), status=error.status)
    if error.status == 408:  # the rest of the body may never come: close the connection after the answer
        response.force_close()
    return response


async def _send_event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")
