"""The OpenAI-compatible HTTP API (aiohttp on the gateway's uvloop), on the same path to the scheduler as gRPC.

Routes: POST /v1/completions, POST /v1/chat/completions (streaming as server-sent events
ending with `data: [DONE]`, or one JSON body), GET /v1/models, GET /health (the gateway is
alive), GET /ready (200 only while a target worker is READY), GET /metrics (Prometheus).

A request body is turned into the gRPC request message and checked by the same
`validate` as gRPC, so both APIs accept and refuse the same things; errors come back in
OpenAI's format with the matching HTTP status, the offending field in `param`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web

from common.logs import get_logger
from gateway.errors import InvalidArgument, RequestFailed
from gateway.generation import Generation
from gateway.health import SERVING, HealthReporter
from gateway.output import Chunk
from gateway.validation import Submission, validate
from proto import specserve_pb2 as pb

HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.INTERNAL: 500,
}
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable",
               500: "internal_error"}
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "error"), "param": self.param,
                          "code": self.code}}
        return web.json_response(body, status=self.status)

    @classmethod
    def from_failure(cls, failure: RequestFailed) -> ApiError:
        param = failure.field.removeprefix("params.") if isinstance(failure, InvalidArgument) else None
        return cls(HTTP_STATUS.get(failure.status, 500), failure.message, param)


class HttpApi:
    def __init__(self, generation: Generation, reporter: HealthReporter, model_name: str) -> None:
        self._generation = generation
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

    def application(self) -> web.Application:
        app = web.Application(middlewares=[self._errors])
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
            return error.response()
        except RequestFailed as failure:
            return ApiError.from_failure(failure).response()
        except web.HTTPException as error:  # unknown route, wrong method
            return ApiError(error.status, error.reason or "not found").response()

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
        body = self._generation.metrics.exposition(info)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # ------------------------------------------------------------------ generation

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        prompt = body.get("prompt")
        message = pb.GenerateRequest()
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            message.prompt = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if (bad := next((t for t in prompt if not 0 <= t <= _INT32_MAX), None)) is not None:
                raise ApiError(400, f"prompt: token id {bad} is outside the vocabulary", "prompt")
            message.token_ids.ids.extend(prompt)
        else:
            raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt")
        return await self._run(request, body, message, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages")
        message = pb.GenerateRequest()
        for index, item in enumerate(messages):
            content = item.get("content") if isinstance(item, dict) else None
            if isinstance(content, list):  # content parts: text only
                texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
                content = "".join(t for t in texts if isinstance(t, str)) if len(texts) == len(content) else None
            if not isinstance(item, dict) or not isinstance(item.get("role"), str) or not isinstance(content, str):
                raise ApiError(400, f"messages[{index}] must have a string role and text content", f"messages[{index}]")
            message.chat.messages.add(role=item["role"], content=content)
        return await self._run(request, body, message, chat=True)

    async def _run(self, request: web.Request, body: dict[str, Any], message: pb.GenerateRequest, *, chat: bool) -> web.StreamResponse:
        if self.draining:
            raise ApiError(503, "the server is shutting down")
        self._num_generating += 1
        self._idle.clear()
        try:
            return await self._generate(request, body, message, chat=chat)
        finally:
            self._num_generating -= 1
            if not self._num_generating:
                self._idle.set()

    async def _generate(self, request: web.Request, body: dict[str, Any], message: pb.GenerateRequest, *,
                        chat: bool) -> web.StreamResponse:
        model = body.get("model")
        if model is not None and model != self._model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self._model_name!r}", "model",
                           "model_not_found")
        max_tokens_as = _sampling_params(body, message, chat=chat)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            submission = validate(message, request_id=request_id, vocab_size=self._generation.tokenizer.vocab_size)
        except InvalidArgument as error:  # named as the client named it, not as the gRPC message does
            field = _client_field(error.field, max_tokens_as=max_tokens_as, chat=chat)
            raise ApiError(400, error.message.replace(error.field, field, 1), field) from error
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
            "speculation": {"draft_tokens": last.speculation.num_draft_tokens,
                            "accepted_draft_tokens": last.speculation.num_accepted_draft_tokens,
                            "verify_steps": last.speculation.num_verify_steps}}


async def _send_event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the body is not valid JSON: {error}") from error
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


# OpenAI (and vLLM) parameters this server does not implement, with the values that ask for nothing: any other value
# is refused, never silently ignored (it would change the output the client expects).
UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "echo": (False,), "suffix": ("",), "best_of": (1,), "presence_penalty": (0,), "frequency_penalty": (0,),
    "repetition_penalty": (1,), "logit_bias": ({},), "min_tokens": (0,), "top_logprobs": (0,),
}
_INT32_MAX = 2**31 - 1


def _max_tokens_field(body: dict[str, Any], *, chat: bool) -> tuple[str, object]:
    """Which field gives the completion's length, as the client named it, and its value (chat: the newer
    max_completion_tokens, else max_tokens; a field sent as null counts as not sent)."""
    if not chat:
        return "max_tokens", body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if body.get("max_completion_tokens") is not None:
        return "max_completion_tokens", body["max_completion_tokens"]
    return "max_tokens", body.get("max_tokens")


def _client_field(field: str, *, max_tokens_as: str, chat: bool) -> str:
    """The body's field that a gRPC field name (InvalidArgument.field) came from."""
    if field.startswith(("token_ids", "prompt")) or field == "input":
        return "messages" if chat else "prompt"
    if field.startswith("chat.messages"):
        return field.removeprefix("chat.")
    field = field.removeprefix("params.")
    return max_tokens_as if field == "max_tokens" else field


def _sampling_params(body: dict[str, Any], message: pb.GenerateRequest, *, chat: bool) -> str:
    """Copy OpenAI's parameters into the gRPC message (types and ranges checked here, values by `validate`); -> the
    field the client gave the completion's length in."""
    params = message.params
    for name, harmless in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not any(value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in harmless):
            raise ApiError(400, f"{name} is not supported by this server (only {harmless[0]!r})", name)
    max_name, max_tokens = _max_tokens_field(body, chat=chat)
    top_k = body.get("top_k")
    seed = body.get("seed")
    fields: dict[str, tuple[str, object, type | tuple[type, ...]]] = {
        "max_tokens": (max_name, max_tokens, int), "temperature": ("temperature", body.get("temperature"), (int, float)),
        "top_p": ("top_p", body.get("top_p"), (int, float)),
        "top_k": ("top_k", None if top_k == -1 else top_k, int),  # -1: no top-k cut, as vLLM has it
        "seed": ("seed", seed % 2**63 if isinstance(seed, int) and not isinstance(seed, bool) else seed, int),
    }
    for name, (given_as, value, kind) in fields.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ApiError(400, f"{given_as} must be a number", given_as)
        if name in ("max_tokens", "top_k") and value > _INT32_MAX:  # type: ignore[operator]
            raise ApiError(400, f"{given_as} must be at most {_INT32_MAX}, got {value}", given_as)
        try:
            setattr(params, name, value)
        except (ValueError, OverflowError, TypeError) as error:  # a number out of the field's range
            raise ApiError(400, f"{given_as} is out of range: {error}", given_as) from error
    if body.get("temperature") is None:
        params.temperature = 1.0  # OpenAI's default
    stop = body.get("stop")
    if isinstance(stop, str):
        params.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        params.stop.extend(stop)
    elif stop is not None:
        raise ApiError(400, "stop must be a string or a list of strings", "stop")
    if body.get("n", 1) != 1:
        raise ApiError(400, "only n=1 is supported", "n")
    if body.get("logprobs") is not None and body.get("logprobs") is not False:  # 0 still asks for logprobs
        raise ApiError(400, "logprobs are not supported", "logprobs")
    if body.get("ignore_eos") is True:  # an extension, as in vLLM
        params.ignore_eos = True
    return max_name
