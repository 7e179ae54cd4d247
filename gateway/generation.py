"""One request from a checked Submission to its output chunks: the path both public APIs (gRPC, HTTP) share.

`Generation.chunks` tokenizes, submits to the scheduler, and yields a Chunk whenever there
is something to send (text, token ids or the finish); it records the request's metrics
and log lines. A prompt is measured before it is tokenized: one with more bytes than the
context's tokens could hold is refused at once, so no prompt costs the gateway more than a
context's worth of tokenizing. Tokenizing runs in threads, a few at a time (it lets the GIL
go, so the event loop and the other streams go on meanwhile).
Leaving the iteration early (a client gone, a stop string) aborts the
request in the scheduler; use it with `contextlib.aclosing`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any, assert_never

from common.cpus import usable_cpus
from common.logs import get_logger
from gateway.cache_scope import CacheScope, page_salt
from gateway.errors import InvalidArgument, RequestFailed
from gateway.metrics import GatewayMetrics
from gateway.output import Chunk, RequestOutput, SpecUsage
from gateway.request import ChatPrompt, Prompt, Submission, TextPrompt, TokenPrompt
from gateway.request_stream import RequestStream
from gateway.scheduler_client import SchedulerClient
from gateway.structured_request import GrammarCompiler
from common.text.tokenizer import ChatMessage, ChatTemplateError, Tokenizer
from proto import messages


class Generation:
    def __init__(
        self,
        tokenizer: Tokenizer,
        scheduler: SchedulerClient,
        metrics: GatewayMetrics,
        grammars: GrammarCompiler | None = None,
        *,
        cache_scope: CacheScope = "global",
    ) -> None:
        self.tokenizer = tokenizer
        self.cache_scope = cache_scope
        self.grammars = grammars  # None: structured output is refused
        self.scheduler = scheduler
        self.metrics = metrics
        self._tokenizing = asyncio.Semaphore(usable_cpus())  # prompts tokenized at once; the others wait their turn
        self._log = get_logger(component="generation")

    async def chunks(self, submission: Submission, api: str) -> AsyncGenerator[Chunk, None]:
        started_at = time.monotonic()
        outcome = "error"
        try:
            prompt_token_ids = await self._prompt_token_ids(submission)
            submit = submission.to_submit_request(
                prompt_token_ids, self.tokenizer.eos_token_ids, page_salt(self.cache_scope, submission)
            )
            output = RequestOutput(self.tokenizer, prompt_token_ids, submission.stop_strings)
            self._log_received(submission, submit)
            self.metrics.prompt_tokens.labels(api).inc(len(prompt_token_ids))
            last_token_at: float | None = None
            async with self.scheduler.open_request(submission.request_id) as stream:
                await self.scheduler.ensure_reachable()
                await stream.submit(submit)
                while True:
                    chunk = await self._next_chunk(stream, output)
                    if chunk.token_ids:
                        now = time.monotonic()
                        self.metrics.observe_tokens(
                            api, len(chunk.token_ids), now - (last_token_at or started_at), first=last_token_at is None
                        )
                        last_token_at = now
                    if chunk.finish_reason is not None:
                        break
                    yield chunk
                if chunk.stop_string is not None:
                    await stream.abort("stop_string")  # sends nothing if the scheduler had finished anyway
            outcome = chunk.finish_reason or "error"
            self._log.info(
                "request.finished",
                finish_reason=chunk.finish_reason,
                stop_string=chunk.stop_string,
                num_prompt_tokens=chunk.num_prompt_tokens,
                num_completion_tokens=chunk.num_completion_tokens,
                num_cached_tokens=chunk.num_cached_tokens,
                num_draft_tokens=chunk.speculation.num_draft_tokens,
                num_accepted_draft_tokens=chunk.speculation.num_accepted_draft_tokens,
                duration_s=round(time.monotonic() - started_at, 3),
            )
        except RequestFailed as error:
            outcome = error.status.name.lower()
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            self.metrics.requests.labels(api, outcome).inc()
        yield chunk  # the last one, after the request is fully accounted for

    async def _prompt_token_ids(self, submission: Submission) -> list[int]:
        return await self.tokenize(submission.prompt, submission.prompt_field)

    async def tokenize(self, prompt: Prompt, field: str, *, special_tokens: bool | None = None) -> list[int]:
        """The prompt's token ids, tokenized off the event loop (text that cannot fit a context refused first, naming
        `field`); `special_tokens` None: as a request's prompt is, else with (True) or without the tokenizer's own."""
        max_bytes = await self.scheduler.max_model_len() * self.tokenizer.longest_token_bytes
        if (size := prompt_bytes(prompt, max_bytes)) > max_bytes:
            longest = self.tokenizer.longest_token_bytes
            raise InvalidArgument(
                field,
                f"holds at least {size} bytes of text: more than a context of "
                f"{max_bytes // longest} tokens can hold (no token of this model stands for more "
                f"than {longest} bytes)",
            )
        async with self._tokenizing:
            return await asyncio.to_thread(prompt_token_ids_of, self.tokenizer, prompt, field, special_tokens)

    async def _next_chunk(self, stream: RequestStream, output: RequestOutput) -> Chunk:
        """Read scheduler messages until one yields something to send (text, ids or the finish)."""
        while True:
            message = await stream.next()
            match message:
                case messages.RequestError():
                    raise RequestFailed.from_scheduler(message)
                case messages.TokenDelta():
                    speculation = SpecUsage(
                        message.num_draft_tokens, message.num_accepted_draft_tokens, message.num_verify_steps
                    )
                    chunk = output.add(
                        message.token_ids,
                        message.finish_reason,
                        speculation,
                        message.num_cached_tokens,
                        logprobs=message.logprobs,
                        prompt_logprobs=message.prompt_logprobs,
                    )
                    if chunk.text or chunk.token_ids or chunk.finish_reason is not None or chunk.prompt_logprobs:
                        return chunk
                case _:
                    assert_never(message)

    def _log_received(self, submission: Submission, submit: messages.SubmitRequest) -> None:
        self._log.info(
            "request.received",
            prompt_kind=type(submission.prompt).__name__,
            num_prompt_tokens=len(submit.prompt_token_ids),
            max_tokens=submit.max_tokens,
            temperature=submit.sampling.temperature,
            top_p=submit.sampling.top_p,
            top_k=submit.sampling.top_k,
            seed_given=submit.seed_given,
            num_stop_strings=len(submission.stop_strings),
            ignore_eos=submission.ignore_eos,
            logprobs=submission.logprobs,
            prompt_logprobs=submission.prompt_logprobs,
        )


def prompt_bytes(prompt: Prompt, max_bytes: int) -> int:
    """The UTF-8 bytes of the prompt's text (a chat's every role and content), or some number over max_bytes once it
    is plainly larger (without encoding it all: a character is at least one byte)."""
    match prompt:
        case TextPrompt(text=text):
            texts: Sequence[str] = (text,)
        case ChatPrompt(messages=chat_messages, template_kwargs=template_kwargs, tools=tools):
            texts = [part for message in chat_messages for part in (message.role, message.content, message.tool_calls)]
            texts += [template_kwargs, tools]
        case TokenPrompt():
            return 0  # its length is checked as ids
        case _:
            assert_never(prompt)
    if sum(map(len, texts)) > max_bytes:
        return sum(map(len, texts))
    return sum(len(text.encode()) for text in texts)


def prompt_token_ids_of(
    tokenizer: Tokenizer, prompt: Prompt, field: str, special_tokens: bool | None = None
) -> list[int]:
    """The prompt as token ids; raises InvalidArgument naming the client's prompt field. `special_tokens`: None as a
    request's prompt is tokenized (text with the tokenizer's own special tokens, a chat without: its template writes
    them), else with or without them."""
    match prompt:
        case TextPrompt(text=text):
            token_ids = tokenizer.encode_raw(text) if special_tokens is False else tokenizer.encode(text)
        case ChatPrompt(messages=chat_messages, template_kwargs=template_kwargs, tools=tools):
            token_ids = chat_token_ids(
                tokenizer,
                chat_messages,
                field,
                special_tokens is True,
                json.loads(template_kwargs) if template_kwargs else None,
                json.loads(tools) if tools else None,
            )
        case TokenPrompt(token_ids=ids):
            token_ids = list(ids)
        case _:
            assert_never(prompt)
    if not token_ids:
        raise InvalidArgument(field, "tokenizes to no tokens")
    return token_ids


def chat_token_ids(
    tokenizer: Tokenizer,
    chat_messages: Sequence[ChatMessage],
    field: str,
    special_tokens: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    if not tokenizer.has_chat_template:
        raise InvalidArgument(field, "the model has no chat template; send prompt or token_ids instead")
    try:
        text = tokenizer.render_chat(chat_messages, template_kwargs, tools)
    except ChatTemplateError as error:
        raise InvalidArgument(field, str(error)) from error
    return tokenizer.encode(text) if special_tokens else tokenizer.encode_raw(text)
