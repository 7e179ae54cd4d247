"""SGLang's native HTTP API beside the OpenAI one, so that programs in SGLang's frontend language (`sgl.function`
with `gen`, `select`, `fork`, regex constraints) run against specserve through `RuntimeEndpoint` unchanged.

Routes: POST /generate (`text` or `input_ids`, one or a list; `sampling_params`;
`return_logprob` with `logprob_start_len`, `top_logprobs_num`, `return_text_in_logprobs`;
`stream`), GET /get_model_info, GET /get_server_info, POST or GET /flush_cache (forgets
the prefix cache's pages no request holds). A request goes through the same checks and
the same path to the scheduler as the other APIs (gateway/validation.py); an error is a
JSON body `{"error": {"message", "param"}}` with its HTTP status.

Log-probabilities come as SGLang writes them: `[logprob, token_id, text]` (text None
unless `return_text_in_logprobs`); the prompt's from position `logprob_start_len` on, the
first prompt token's logprob None.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web

from gateway.choices import run_all
from gateway.errors import RequestFailed
from gateway.generation import Generation
from gateway.http_body import TENANT, BodyLimits, json_body, reply_json
from gateway.openai_logprobs import Scored, TokenTexts, finite
from gateway.openai_request import ApiError
from gateway.output import Chunk
from gateway.request import ClientRequest, Prompt, TextPrompt, TokenPrompt
from gateway.structured_request import Asked, SpecError, parsed_schema
from gateway.validation import FieldNames, checked_request_id, validate
from common.text.structured import StructuredSpec
from proto.messages import MAX_TOP_LOGPROBS

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's
MAX_PROMPTS = 64
SGLANG_FIELDS = FieldNames(
    text_prompt="text",
    chat="text",
    chat_messages="text",
    chat_role="text",
    token_ids="input_ids",
    token_id="input_ids",
    max_tokens="sampling_params.max_new_tokens",
    temperature="sampling_params.temperature",
    top_p="sampling_params.top_p",
    top_k="sampling_params.top_k",
    min_p="sampling_params.min_p",
    seed="sampling_params.sampling_seed",
    stop_strings="sampling_params.stop",
    stop_string="sampling_params.stop[{index}]",
    stop_token_id="sampling_params.stop_token_ids[{index}]",
    logprobs="top_logprobs_num",
    prompt_logprobs="top_logprobs_num",
    presence_penalty="sampling_params.presence_penalty",
    frequency_penalty="sampling_params.frequency_penalty",
    repetition_penalty="sampling_params.repetition_penalty",
    logit_bias="sampling_params.logit_bias",
    min_tokens="sampling_params.min_new_tokens",
)
# Sampling parameters SGLang's frontend sends that change nothing here (special tokens are always left out of text).
_IGNORED = frozenset({"skip_special_tokens", "spaces_between_special_tokens"})
# The /generate body's own fields read here; any other (image_data, lora_path, return_hidden_states ...) is refused
# naming it, as the sampling parameters are.
_BODY_FIELDS = frozenset(
    {
        "text",
        "input_ids",
        "sampling_params",
        "return_logprob",
        "return_text_in_logprobs",
        "top_logprobs_num",
        "logprob_start_len",
        "stream",
        "cache_salt",
        "rid",
        "priority",
    }
)
_KNOWN = (
    frozenset(
        {
            "max_new_tokens",
            "min_new_tokens",
            "stop",
            "stop_token_ids",
            "stop_regex",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
            "ignore_eos",
            "regex",
            "json_schema",
            "ebnf",
            "sampling_seed",
            "n",
            "no_stop_trim",
        }
    )
    | _IGNORED
)


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
        body = await json_body(request, self._limits)
        for key, value in body.items():
            if key not in _BODY_FIELDS and value is not None:
                raise ApiError(400, f"{key} is not supported by this server", key)
        prompts, single = _prompts(body)
        params = {} if body.get("sampling_params") is None else body["sampling_params"]
        if not isinstance(params, dict):
            raise ApiError(400, "sampling_params must be an object", "sampling_params")
        return_logprob = _flag(body, "return_logprob")
        with_text = _flag(body, "return_text_in_logprobs")
        top = _integer(body, "top_logprobs_num", 0)
        start = _integer(body, "logprob_start_len", -1)
        stream = _flag(body, "stream")
        if stream and not single:
            raise ApiError(400, "stream takes one prompt", "stream")
        cache_salt = body.get("cache_salt")  # as in vLLM's bodies
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ApiError(400, "cache_salt must be a string", "cache_salt")
        priority = body.get("priority")  # as in SGLang's bodies: lower first under a priority scheduler
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
            raise ApiError(400, "priority must be an integer", "priority")
        request_ids = _request_ids(body.get("rid"), len(prompts), single)
        jobs = []
        for index, prompt in enumerate(prompts):
            client_request = _client_request(
                params, prompt, logprobs=top if return_logprob else None, scores_prompt=return_logprob and start >= 0
            )
            client_request = dataclasses.replace(client_request, cache_salt=cache_salt, priority=priority)
            submission = validate(
                client_request,
                fields=SGLANG_FIELDS,
                vocab_size=self._generation.tokenizer.vocab_size,
                request_id=request_ids[index],
                grammars=self._generation.grammars,
            )
            submission = dataclasses.replace(submission, tenant=request.get(TENANT))
            jobs.append(_Job(submission.request_id, return_logprob, with_text, max(start, 0), self._texts, submission))
        if stream:
            return await self._stream(request, jobs[0])
        await run_all([self._collect(job) for job in jobs])
        answers = [job.answer() for job in jobs]
        return web.json_response(answers[0] if single else answers, dumps=reply_json)

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


def _prompts(body: dict[str, Any]) -> tuple[list[Prompt], bool]:
    """`text` or `input_ids`, one or a list; whether it was one."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ApiError(400, "give one of text and input_ids", "text")
    if isinstance(text, str):
        return [TextPrompt(text)], True
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        return _limited([TextPrompt(t) for t in text], "text"), False
    if isinstance(ids, list) and _is_ids(ids):
        return [TokenPrompt(tuple(ids))], True
    if isinstance(ids, list) and ids and all(_is_ids(one) for one in ids):
        return _limited([TokenPrompt(tuple(one)) for one in ids], "input_ids"), False
    name = "text" if text is not None else "input_ids"
    raise ApiError(400, f"{name} must be a string or a list of token ids, or a non-empty list of those", name)


def _limited(prompts: list[Prompt], field: str) -> list[Prompt]:
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"{len(prompts)} prompts, at most {MAX_PROMPTS} at once", field)
    return prompts


def _request_ids(rid: object, num_prompts: int, single: bool) -> list[str]:
    """Each prompt's id as its replies carry it: `rid` (one string, numbered per prompt for a batch, or a list of one
    per prompt), else one made here. Only replies carry it: the scheduler knows requests by the gateway's own ids."""
    if isinstance(rid, list) and not single:
        if len(rid) != num_prompts or not all(isinstance(r, str) for r in rid):
            raise ApiError(400, f"rid must be a string or a list of {num_prompts} strings, one per prompt", "rid")
        return [checked_request_id(r, field=f"rid[{index}]") for index, r in enumerate(rid)]
    if rid is not None and not isinstance(rid, str):
        raise ApiError(400, "rid must be a string" + ("" if single else " or a list of strings, one per prompt"), "rid")
    base = checked_request_id(rid, field="rid") if rid else f"sgl-{uuid.uuid4().hex}"
    return [base] if single else [f"{base}-{index}" for index in range(num_prompts)]


def _is_ids(value: object) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _client_request(
    params: dict[str, Any], prompt: Prompt, *, logprobs: int | None, scores_prompt: bool
) -> ClientRequest:
    for key, value in params.items():
        if key not in _KNOWN:
            raise ApiError(400, f"sampling_params.{key} is not supported by this server", f"sampling_params.{key}")
    for key, harmless in (("stop_regex", None), ("ebnf", None), ("n", 1), ("no_stop_trim", False)):
        if params.get(key) not in (harmless, None, [], ()):
            raise ApiError(
                400,
                f"sampling_params.{key} is not supported by this server (only {harmless!r})",
                f"sampling_params.{key}",
            )
    max_new_tokens = params.get("max_new_tokens")
    max_new_tokens = DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
    top_k = params.get("top_k")
    numbers = {
        name: params.get(name)
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
    }
    integers = {
        "max_new_tokens": max_new_tokens,
        "top_k": top_k,
        "min_new_tokens": params.get("min_new_tokens"),
        "sampling_seed": params.get("sampling_seed"),
    }
    # Only the types here; the values (NaN, infinities, ranges) are checked by `validate`, which names these fields too.
    for name, value in [*numbers.items(), *integers.items()]:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ApiError(400, f"sampling_params.{name} must be a number", f"sampling_params.{name}")
        if value is not None and name in integers and not isinstance(value, int):
            raise ApiError(400, f"sampling_params.{name} must be an integer", f"sampling_params.{name}")
    for name in ("ignore_eos", *_IGNORED):
        if params.get(name) is not None and not isinstance(params[name], bool):
            raise ApiError(400, f"sampling_params.{name} must be a boolean", f"sampling_params.{name}")
    stop = params.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "sampling_params.stop must be a string or a list of strings", "sampling_params.stop")
    stop_ids = params.get("stop_token_ids")
    stop_ids = () if stop_ids is None else stop_ids
    if not isinstance(stop_ids, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in stop_ids
    ):
        raise ApiError(
            400, "sampling_params.stop_token_ids must be a list of token ids", "sampling_params.stop_token_ids"
        )
    # max_new_tokens 0 scores the prompt (what the frontend sends to cache a prefix or to select among choices).
    scoring = scores_prompt or max_new_tokens == 0
    return ClientRequest(
        prompt=prompt,
        max_tokens=max_new_tokens,
        temperature=1.0 if numbers["temperature"] is None else numbers["temperature"],
        top_p=numbers["top_p"],
        top_k=None if top_k in (None, -1) else top_k,
        min_p=numbers["min_p"],
        seed=params.get("sampling_seed"),
        stop_strings=tuple(stop),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=params.get("ignore_eos") is True,
        logprobs=logprobs,
        prompt_logprobs=(logprobs or 0) if scoring else None,
        presence_penalty=numbers["presence_penalty"],
        frequency_penalty=numbers["frequency_penalty"],
        repetition_penalty=numbers["repetition_penalty"],
        min_tokens=params.get("min_new_tokens") or None,
        structured=_structured(params),
    )


def _structured(params: dict[str, Any]) -> Asked | None:
    regex, schema = params.get("regex"), params.get("json_schema")
    if regex is not None and schema is not None:
        raise ApiError(400, "give regex or json_schema, not both", "sampling_params.json_schema")
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise ApiError(400, "sampling_params.regex must be a non-empty string", "sampling_params.regex")
        return "sampling_params.regex", StructuredSpec("regex", regex)
    if schema is not None:
        field = "sampling_params.json_schema"
        try:
            parsed = parsed_schema(field, schema)  # bounded before it is parsed; the text kept, its keys in order
        except SpecError as error:
            raise ApiError(400, f"{field} {error}", field) from error
        return field, StructuredSpec("json_schema", schema if isinstance(schema, str) else json.dumps(parsed))
    return None


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a boolean", name)
    return value


def _integer(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer", name)
    if name == "top_logprobs_num" and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"{name} must be 0 to {MAX_TOP_LOGPROBS}, got {value}", name)
    return value
