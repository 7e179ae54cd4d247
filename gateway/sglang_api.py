"""SGLang's native HTTP API beside the OpenAI one, so that programs in SGLang's frontend language (`sgl.function`
with `gen`, `select`, `fork`, regex constraints) run against specserve through `RuntimeEndpoint` unchanged.

Routes: POST /generate (`text` or `input_ids`, one or a list; `sampling_params`;
`return_logprob` with `logprob_start_len`, `top_logprobs_num`, `return_text_in_logprobs`;
`stream`), GET /get_model_info, GET /get_server_info, POST or GET /flush_cache (forgets
the prefix cache's pages no request holds). A /generate body becomes ClientRequests in
sglang_request.py, then goes through the same checks and the same path to the scheduler as
the other APIs (gateway/validation.py); an error is a JSON body
`{"error": {"message", "param"}}` with its HTTP status.

Log-probabilities come as SGLang writes them: `[logprob, token_id, text]` (text None
unless `return_text_in_logprobs`); the prompt's from position `logprob_start_len` on, the
first prompt token's logprob None.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web

from gateway.choices import run_all
from gateway.errors import RequestFailed
from gateway.generation import Generation
from gateway.http_body import TENANT, BodyLimits, json_body, reply_json
from gateway.openai_logprobs import Scored, TokenTexts, finite
from gateway.output import Chunk
from gateway.sglang_request import SGLANG_FIELDS, generate_body
from gateway.validation import validate


class SglangApi:
    def __init__(self, generation: Generation, model_name: str, limits: BodyLimits) -> None:
        self._generation = generation
        self._model_name = model_name
        self._limits = limits
        self._texts = TokenTexts(generation.tokenizer)

    def add_routes(
        self,
        app: web.Application,
        counted: Callable[[Coroutine[Any, Any, web.StreamResponse]], Awaitable[web.StreamResponse]],
    ) -> None:
        """The routes; `counted` admits a generation (refused while draining, counted in flight)."""

        async def generate(request: web.Request) -> web.StreamResponse:
            return await counted(self.generate(request))

        app.router.add_post("/generate", generate)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_post("/flush_cache", self.flush_cache)
        app.router.add_get("/flush_cache", self.flush_cache)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self._model_name,
                "tokenizer_path": self._model_name,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        info = await self._generation.scheduler.query_info()
        return web.json_response(
            {
                "model_path": self._model_name,
                "served_model_name": self._model_name,
                "max_total_num_tokens": None,
                "context_length": info.max_model_len,
                "num_waiting": info.num_waiting,
                "num_running": info.num_running,
                "processes": [
                    {"process_id": p.process_id, "role": p.role, "state": p.state, "kernels": p.kernels}
                    for p in info.processes
                ],
                "version": "specserve",
            }
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        await self._generation.scheduler.query_info(flush_prefix_cache=True)
        return web.Response(text="Cache flushed.\n")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        asked = generate_body(await json_body(request, self._limits))
        jobs = []
        for request_id, client_request in asked.requests:
            submission = validate(
                client_request,
                fields=SGLANG_FIELDS,
                vocab_size=self._generation.tokenizer.vocab_size,
                request_id=request_id,
                grammars=self._generation.grammars,
            )
            submission = dataclasses.replace(submission, tenant=request.get(TENANT))
            jobs.append(
                _Job(
                    submission.request_id,
                    asked.return_logprob,
                    asked.with_text,
                    asked.logprob_start,
                    self._texts,
                    submission,
                )
            )
        if asked.stream:
            return await self._stream(request, jobs[0])
        await run_all([self._collect(job) for job in jobs])
        answers = [job.answer() for job in jobs]
        return web.json_response(answers[0] if asked.single else answers, dumps=reply_json)

    async def _collect(self, job: _Job) -> None:
        async with contextlib.aclosing(self._generation.chunks(job.submission, "sglang")) as chunks:
            async for chunk in chunks:
                job.take(chunk)

    async def _stream(self, request: web.Request, job: _Job) -> web.StreamResponse:
        chunks = self._generation.chunks(job.submission, "sglang")
        async with contextlib.aclosing(chunks):
            first = await anext(chunks)  # an early failure is still an ordinary error response
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            chunk = first
            try:
                while True:
                    job.take(chunk)
                    if chunk.text or chunk.token_ids or chunk.finish_reason is not None:
                        await response.write(b"data: " + reply_json(job.answer()).encode() + b"\n\n")
                    if chunk.finish_reason is not None:
                        break
                    chunk = await anext(chunks)
                await response.write(b"data: [DONE]\n\n")
            except RequestFailed as failure:
                await response.write(b"data: " + json.dumps({"error": {"message": failure.message}}).encode() + b"\n\n")
        await response.write_eof()
        return response


class _Job:
    """One prompt's request and what came back, in SGLang's shape."""

    def __init__(
        self, request_id: str, return_logprob: bool, with_text: bool, start: int, texts: TokenTexts, submission: Any
    ) -> None:
        self.request_id, self.return_logprob, self.with_text, self.start = request_id, return_logprob, with_text, start
        self.texts, self.submission = texts, submission
        self.text: list[str] = []
        self.prompt: list[Scored] = []
        self.output: list[Scored] = []
        self.last: Chunk | None = None

    def take(self, chunk: Chunk) -> None:
        self.text.append(chunk.text)
        self.prompt += chunk.prompt_logprobs or []
        if chunk.logprobs is not None:
            self.output += zip(chunk.token_ids, chunk.logprobs)
        if chunk.finish_reason is not None:
            self.last = chunk

    def answer(self) -> dict[str, Any]:
        last = self.last
        meta: dict[str, Any] = {
            "id": self.request_id,
            "prompt_tokens": last.num_prompt_tokens if last else None,
            "completion_tokens": last.num_completion_tokens if last else len(self.output),
            "cached_tokens": last.num_cached_tokens if last else 0,
            "finish_reason": _finish_reason(last),
        }
        if self.return_logprob:
            prompt = self.prompt[self.start :]
            meta["input_token_logprobs"] = [self._entry(token, entry) for token, entry in prompt]
            meta["output_token_logprobs"] = [self._entry(token, entry) for token, entry in self.output]
            meta["input_top_logprobs"] = [self._top(entry) for _, entry in prompt]
            meta["output_top_logprobs"] = [self._top(entry) for _, entry in self.output]
        return {"text": "".join(self.text), "meta_info": meta}

    def _entry(self, token: int, entry: Any) -> list[Any]:
        return [None if entry is None else finite(entry.logprob), token, self.texts(token) if self.with_text else None]

    def _top(self, entry: Any) -> list[list[Any]] | None:
        if entry is None:
            return None
        return [[finite(t.logprob), t.token_id, self.texts(t.token_id) if self.with_text else None] for t in entry.top]


def _finish_reason(last: Chunk | None) -> dict[str, Any] | None:
    if last is None or last.finish_reason is None:
        return None
    if last.finish_reason == "length":
        return {"type": "length", "length": last.num_completion_tokens}
    if last.finish_reason == "stop":
        return {
            "type": "stop",
            "matched": last.stop_string
            if last.stop_string is not None
            else (last.token_ids[-1] if last.token_ids else None),
        }
    return {"type": "abort"}
