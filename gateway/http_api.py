"""The OpenAI-compatible HTTP API (aiohttp on the gateway's uvloop), on the same path to the scheduler as gRPC.

Routes: POST /v1/completions, POST /v1/chat/completions (streaming as server-sent events
ending with `data: [DONE]`, or one JSON body), GET /v1/models, GET /health (the gateway is
alive), GET /ready (200 only while a target worker is READY), GET /metrics (Prometheus),
and SGLang's native routes (gateway/sglang_api.py).

A request body becomes a ClientRequest (openai_request.py) checked by the same `validate`
as gRPC's, so both APIs accept and refuse the same things; errors come back in OpenAI's
format with the matching HTTP status, the offending field, named as in the body, in `param`.
A body is read within BodyLimits (http_body.py): its size, the time it takes to arrive, its
charset, how deep it nests and whether its text is valid Unicode.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web

from common.logs import get_logger
from gateway.access import HEADER, OPEN_PATHS, ApiKeys
from gateway.api_error import ApiError
from gateway.choices import interleaved, run_all, sibling
from gateway.cors import Cors
from gateway.errors import RequestFailed
from gateway.generation import Generation
from gateway.health import SERVING, HealthReporter
from gateway.http_body import TENANT, BodyLimits, json_body, reply_json
from gateway.openai_answer import Choice, Shape, best_choices
from gateway.openai_logprobs import TokenTexts
from gateway.openai_chat_prompt import chat_prompt
from gateway.openai_request import choice_counts, client_request_of, completion_prompts
from gateway.output_formats import ReasoningParser, ToolCallParser
from gateway.request import ChatPrompt, Prompt, TextPrompt, TokenPrompt
from gateway.sglang_api import SglangApi
from gateway.tokenize_api import detokenize_body, tokenize_body
from gateway.tools import ToolAsk, call_grammar, tool_ask
from gateway.validation import validate
from common.text.structured import StructuredSpec


class HttpApi:
    def __init__(
        self,
        generation: Generation,
        reporter: HealthReporter,
        model_name: str,
        limits: BodyLimits = BodyLimits(),
        keys: ApiKeys = ApiKeys(),
        cors: Cors = Cors(),
        reasoning: ReasoningParser | None = None,
        tool_parser: ToolCallParser | None = None,
        client_certificates: bool = False,
    ) -> None:
        self._generation = generation
        # Mutual TLS (gateway/tls.py): the handshake checked any certificate given; a connection without one is
        # for the probes' routes only.
        self._client_certificates = client_certificates
        self._tool_parser = tool_parser  # the format the model writes tool calls in (gateway/tools.py)
        self._reasoning = reasoning  # chat answers' reasoning apart from their content (gateway/reasoning.py)
        self._keys = keys
        self._cors = cors
        self._limits = limits
        self._reporter = reporter
        self._model_name = model_name
        self._texts = TokenTexts(generation.tokenizer)
        self._sglang = SglangApi(generation, model_name, limits)
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
        return web.AppRunner(
            self.application(),
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=self._limits.read_timeout_s,
        )

    def application(self) -> web.Application:
        app = web.Application(
            middlewares=[self._errors, self._cors.preflight, self._access], client_max_size=self._limits.max_body_bytes
        )
        app.on_response_prepare.append(self._cors.on_prepare)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics)
        self._sglang.add_routes(app, self._counted)
        return app

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
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

    @web.middleware
    async def _access(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """With API keys, every route but the probes' wants one (gateway/access.py); the caller's tenant is kept in
        the request for the handlers. A missing key and a wrong one get the same 401. With mutual TLS, every route but
        the probes' wants the connection to have presented a client certificate (the handshake verified it)."""
        if request.path in OPEN_PATHS:
            return await handler(request)
        if self._client_certificates and not (request.transport and request.transport.get_extra_info("peercert")):
            return error_response(
                ApiError(
                    401,
                    "a client certificate is required: this port serves mutual TLS, and this connection presented none",
                    None,
                    "client_certificate_required",
                )
            )
        if self._keys.required:
            tenant = self._keys.tenant(request.headers.get(HEADER))
            if tenant is None:
                error = error_response(
                    ApiError(401, "a valid API key is required: Authorization: Bearer KEY", None, "invalid_api_key")
                )
                error.headers["WWW-Authenticate"] = "Bearer"
                return error
            request[TENANT] = tenant
        return await handler(request)

    # ------------------------------------------------------------------ the simple routes

    async def models(self, request: web.Request) -> web.Response:
        """The model, once a target worker serving it is READY (as /ready says); before that, and while none is, the
        list is empty: a client that reads the list as what it can use now is never told of a model nothing serves."""
        served = [{"id": self._model_name, "object": "model", "created": self._created, "owned_by": "specserve"}]
        return web.json_response({"object": "list", "data": served if self._reporter.status == SERVING else []})

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
        return await self._run(request, body, completion_prompts(body), chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await json_body(request, self._limits)
        return await self._run(request, body, [chat_prompt(body)], chat=True)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await json_body(request, self._limits)
        return web.json_response(await tokenize_body(self._generation, body), dumps=reply_json)

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await json_body(request, self._limits)
        return web.json_response(await detokenize_body(self._generation, body), dumps=reply_json)

    async def _run(
        self, request: web.Request, body: dict[str, Any], prompts: list[Prompt], *, chat: bool
    ) -> web.StreamResponse:
        return await self._counted(self._generate(request, body, prompts, chat=chat))

    async def _counted(self, generation: Coroutine[Any, Any, web.StreamResponse]) -> web.StreamResponse:
        """A generation request: refused while draining, else counted in flight until it ends."""
        if self.draining:
            generation.close()
            raise ApiError(503, "the server is shutting down")
        self._num_generating += 1
        self._idle.clear()
        try:
            return await generation
        finally:
            self._num_generating -= 1
            if not self._num_generating:
                self._idle.set()

    async def _generate(
        self, request: web.Request, body: dict[str, Any], prompts: list[Prompt], *, chat: bool
    ) -> web.StreamResponse:
        """Every request checked before any starts: `best_of` (else `n`) of each prompt, each a choice of the answer."""
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, "model must be a string", "model")
        if model is not None and model != self._model_name:
            raise ApiError(
                404,
                f"the model {model!r} does not exist; this server serves {self._model_name!r}",
                "model",
                "model_not_found",
            )
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "stream must be a boolean", "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object", "stream_options")
        if options.get("include_usage") is not None and not isinstance(options["include_usage"], bool):
            raise ApiError(400, "stream_options.include_usage must be a boolean", "stream_options.include_usage")
        counts = choice_counts(body, chat=chat, stream=stream, num_prompts=len(prompts))
        tools = self._tools(body) if chat else None
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        choices: list[Choice] = []
        for prompt_index, prompt in enumerate(prompts):
            if tools is not None and isinstance(prompt, ChatPrompt):
                prompt = dataclasses.replace(prompt, tools=json.dumps(tools.tools))
            client_request, fields = client_request_of(body, prompt, chat=chat)
            if tools is not None and tools.constrained:
                if client_request.structured is not None:
                    raise ApiError(
                        400,
                        f"tool_choice {tools.choice!r} makes the answer a call: it cannot follow "
                        f"{client_request.structured[0]} too",
                        "tool_choice",
                    )
                assert self._tool_parser is not None  # _tools checked it
                grammar = StructuredSpec("grammar", call_grammar(tools, self._tool_parser))
                client_request = dataclasses.replace(client_request, structured=("tool_choice", grammar))
            shown = client_request.logprobs is not None
            if counts.ranks and not shown:  # the best are chosen by their log-probabilities
                client_request = dataclasses.replace(client_request, logprobs=0)
            submission = validate(
                client_request,
                fields=fields,
                request_id=request_id,
                vocab_size=self._generation.tokenizer.vocab_size,
                grammars=self._generation.grammars,
            )
            submission = dataclasses.replace(submission, tenant=request.get(TENANT))
            echo = self._echo_text(prompt) if not chat and body.get("echo") is True else None
            lead: Choice | None = None
            for copy in range(counts.best_of):
                ordinal = len(choices)
                one_request = len(prompts) == 1 and counts.best_of == 1
                choice = Choice(
                    prompt_index * counts.n + copy,
                    prompt_index,
                    sibling(
                        submission,
                        copy,
                        request_id if one_request else f"{request_id}-{ordinal}",
                        scores_prompt=lead is None or client_request.max_tokens == 0,
                    ),
                    shown,
                    self._texts,
                    echo=echo,
                    lead=lead,
                )
                lead = lead or choice
                choices.append(choice)
        shape = Shape(
            request_id,
            self._model_name,
            chat,
            self._reasoning if chat else None,
            None if tools is None or self._tool_parser is None else (tools, self._tool_parser),
        )
        if stream:
            return await self._stream(request, choices, shape, bool(options.get("include_usage", False)))
        return await self._whole(choices, shape, counts.n)

    def _tools(self, body: dict[str, Any]) -> ToolAsk | None:
        """The tools a chat request offers to call (gateway/tools.py), where this server can serve them."""
        tools = tool_ask(body)
        if tools is None:
            return None
        if self._tool_parser is None:
            raise ApiError(
                400, "tools: this server reads no tool calls (its gateway runs without --tool-call-parser)", "tools"
            )
        if not self._generation.tokenizer.template_takes_tools:
            raise ApiError(
                400,
                "tools: the model's chat template takes no tools (a template that does can be given "
                "with the gateway's --chat-template)",
                "tools",
            )
        return tools

    def _echo_text(self, prompt: Prompt) -> str:
        match prompt:
            case TextPrompt(text=text):
                return text
            case TokenPrompt(token_ids=token_ids):
                return self._generation.tokenizer.decode(token_ids)
            case _:
                raise ApiError(400, "echo is for /v1/completions", "echo")

    async def _whole(self, choices: list[Choice], shape: Shape, n: int) -> web.Response:
        async def collect(choice: Choice) -> None:
            async with contextlib.aclosing(choice.copy.chunks(self._generation, "http")) as chunks:
                async for chunk in chunks:
                    choice.take(chunk)

        await run_all([collect(choice) for choice in choices])
        return web.json_response(shape.whole(best_choices(choices, n), choices), dumps=reply_json)

    async def _stream(
        self, request: web.Request, choices: list[Choice], shape: Shape, include_usage: bool
    ) -> web.StreamResponse:
        events = interleaved([choice.copy for choice in choices], self._generation, "http")
        try:
            # The first chunk comes before the answer's 200, so an early failure (bad prompt, queue full, no worker)
            # is still an ordinary error response.
            index, first = await anext(events)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            try:
                if shape.chat:
                    for each in choices:
                        await _send_event(
                            response, shape.delta_event(each.index, {"role": "assistant", "content": ""}, None, None)
                        )
                for payload in shape.stream_events(choices[index], first):
                    await _send_event(response, payload)
                async for index, chunk in events:
                    for payload in shape.stream_events(choices[index], chunk):
                        await _send_event(response, payload)
                if include_usage:
                    await _send_event(response, shape.usage_event(choices))
                await response.write(b"data: [DONE]\n\n")
            except RequestFailed as failure:  # after the 200: report it in the stream, as OpenAI does
                await _send_event(response, {"error": {"message": failure.message, "code": failure.status.name}})
            except ConnectionResetError:
                self._log.info("request.client_gone", request_id=shape.request_id)  # the requests are aborted below
                raise
        finally:
            await events.aclose()
        await response.write_eof()
        return response


def error_response(error: ApiError) -> web.Response:
    response = web.json_response(error.body(), status=error.status, dumps=reply_json)
    if error.status == 408:  # the rest of the body may never come: close the connection after the answer
        response.force_close()
    return response


async def _send_event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + reply_json(payload, ensure_ascii=False).encode() + b"\n\n")
