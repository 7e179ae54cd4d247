"""The SpecServe gRPC servicer: decode, validate, tokenize, submit to the scheduler, stream the output back."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import msgspec
import structlog
from google.protobuf.message import DecodeError, Message

from common.logs import get_logger
from gateway.access import HEADER, ApiKeys
from gateway.choices import Copy, interleaved, sibling
from gateway.errors import InvalidArgument, RequestFailed
from gateway.generation import Generation
from gateway.grpc_request import prompt_of, refuse_unknown_fields, request_id_of, submission_of
from gateway.openai_request import MAX_CHOICES
from gateway.output import Chunk
from gateway.tokenize_api import detokenize, token_strs
from proto import messages
from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["SpecServe"].full_name
RequestT = TypeVar("RequestT", bound=Message)
ReplyT = TypeVar("ReplyT")

FINISH_REASONS: dict[messages.FinishReason, pb.FinishReason] = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


class SpecServeServicer(pb_grpc.SpecServeServicer):
    """Generate and GetServerInfo; every request's log lines carry its request_id."""

    def __init__(self, generation: Generation, keys: ApiKeys = ApiKeys()) -> None:
        self._generation = generation
        self._keys = keys
        self._scheduler = generation.scheduler
        self._log = get_logger(component="servicer")

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Server-streaming: chunks are written with context.write so cancellation lands in this task."""
        started_at = time.monotonic()
        tenant = await self._caller(context)
        try:
            request_id = request_id_of(request, generated_id=uuid.uuid4().hex)
            # Each RPC runs in its own task with its own context: this binding ends with the request.
            structlog.contextvars.bind_contextvars(request_id=request_id)
            await self._generate(request, request_id, tenant, context)
        except RequestFailed as error:
            self._log.info("request.failed", status=error.status.name, message=error.message)
            await context.abort(error.status, error.message)
        except asyncio.CancelledError:
            self._log.info("request.cancelled", duration_s=round(time.monotonic() - started_at, 3))
            raise
        except Exception as error:  # recoverable: this request fails, the gateway lives on
            self._log.exception("request.internal_error", error_type=type(error).__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in the gateway: {type(error).__name__}")

    async def GetServerInfo(
        self, request: pb.ServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerInfoResponse:
        await self._caller(context)
        async with failures_as_status(context):
            return to_server_info(await self._scheduler.query_info())
        raise AssertionError("not reached: a failure aborts the call")

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        await self._caller(context)
        async with failures_as_status(context):
            refuse_unknown_fields(request)
            prompt = prompt_of(request)
            field = request.WhichOneof("input") or "input"
            special = request.add_special_tokens if request.HasField("add_special_tokens") else None
            token_ids = await self._generation.tokenize(prompt, field, special_tokens=special)
            return pb.TokenizeResponse(
                token_ids=token_ids,
                max_model_len=await self._scheduler.max_model_len(),
                token_strs=token_strs(self._generation, token_ids) if request.return_token_strs else [],
            )
        raise AssertionError("not reached: a failure aborts the call")

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        await self._caller(context)
        async with failures_as_status(context):
            refuse_unknown_fields(request)
            return pb.DetokenizeResponse(text=await detokenize(self._generation, request.token_ids, "token_ids"))
        raise AssertionError("not reached: a failure aborts the call")

    async def _caller(self, context: grpc.aio.ServicerContext) -> str | None:
        """The caller's tenant (gateway/access.py); with keys required and no valid one in the metadata, the call ends
        UNAUTHENTICATED (the same for a missing key and a wrong one)."""
        if not self._keys.required:
            return None
        presented = [value for key, value in context.invocation_metadata() or () if key == HEADER]
        tenant = self._keys.tenant(presented[0] if len(presented) == 1 and isinstance(presented[0], str) else None)
        if tenant is None:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required: metadata authorization: Bearer KEY"
            )
        return tenant

    async def _generate(
        self, request: pb.GenerateRequest, request_id: str, tenant: str | None, context: grpc.aio.ServicerContext
    ) -> None:
        submission = submission_of(
            request,
            request_id=request_id,
            vocab_size=self._generation.tokenizer.vocab_size,
            grammars=self._generation.grammars,
        )
        submission = dataclasses.replace(submission, tenant=tenant)
        n = request.n if request.HasField("n") else 1
        if not 1 <= n <= MAX_CHOICES:
            raise InvalidArgument("n", f"must be 1 to {MAX_CHOICES}, got {n}")
        if n == 1:
            async with contextlib.aclosing(self._generation.chunks(submission, "grpc")) as chunks:
                async for chunk in chunks:
                    await write_chunk(context, chunk, request_id)
            return
        copies: list[Copy] = []
        for index in range(n):
            scores = not copies or submission.max_tokens == 0
            copies.append(
                Copy(
                    sibling(submission, index, f"{request_id}-{index}", scores_prompt=scores),
                    copies[0] if copies else None,
                )
            )
        async with contextlib.aclosing(interleaved(copies, self._generation, "grpc")) as chunks:
            async for index, chunk in chunks:
                response = to_response(chunk, request_id)
                response.choice_index = index
                await context.write(response)


@contextlib.asynccontextmanager
async def failures_as_status(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """A unary call's RequestFailed ends it with that status and message (abort raises, ending the call)."""
    try:
        yield
    except RequestFailed as error:
        await context.abort(error.status, error.message)


def add_servicer(server: grpc.aio.Server, servicer: SpecServeServicer) -> None:
    """Registers SpecServe as the generated code does, except that requests arrive as bytes and are decoded in the
    call: grpc turns a deserializer's exception into UNKNOWN, and bytes that are no request are INVALID_ARGUMENT."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            decoding(pb.GenerateRequest, servicer.Generate), response_serializer=pb.GenerateResponse.SerializeToString
        ),
        "GetServerInfo": grpc.unary_unary_rpc_method_handler(
            decoding(pb.ServerInfoRequest, servicer.GetServerInfo),
            response_serializer=pb.ServerInfoResponse.SerializeToString,
        ),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            decoding(pb.TokenizeRequest, servicer.Tokenize), response_serializer=pb.TokenizeResponse.SerializeToString
        ),
        "Detokenize": grpc.unary_unary_rpc_method_handler(
            decoding(pb.DetokenizeRequest, servicer.Detokenize),
            response_serializer=pb.DetokenizeResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def decoding(
    request_type: type[RequestT], method: Callable[[RequestT, grpc.aio.ServicerContext], Awaitable[ReplyT]]
) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[ReplyT]]:
    """`method` called with the request decoded from its bytes; bytes that do not decode abort INVALID_ARGUMENT."""

    async def call(raw: bytes, context: grpc.aio.ServicerContext) -> ReplyT:
        try:
            request = request_type.FromString(raw)
        except DecodeError as error:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request is not a valid {request_type.DESCRIPTOR.full_name}: {error}",
            )
            raise  # not reached: abort raises
        return await method(request, context)

    return call


async def write_chunk(context: grpc.aio.ServicerContext, chunk: Chunk, request_id: str) -> None:
    await context.write(to_response(chunk, request_id))


def to_response(chunk: Chunk, request_id: str) -> pb.GenerateResponse:
    response = pb.GenerateResponse(text=chunk.text, token_ids=chunk.token_ids, request_id=request_id)
    if chunk.logprobs is not None:
        response.logprobs.extend(to_token_logprob(t, entry) for t, entry in zip(chunk.token_ids, chunk.logprobs))
    if chunk.prompt_logprobs:
        response.prompt_logprobs.extend(to_token_logprob(t, entry) for t, entry in chunk.prompt_logprobs if entry)
    if chunk.finish_reason is not None:
        response.finish_reason = FINISH_REASONS[chunk.finish_reason]
        response.usage.prompt_tokens = chunk.num_prompt_tokens
        response.usage.completion_tokens = chunk.num_completion_tokens
        response.usage.draft_tokens = chunk.speculation.num_draft_tokens
        response.usage.accepted_draft_tokens = chunk.speculation.num_accepted_draft_tokens
        response.usage.verify_steps = chunk.speculation.num_verify_steps
        response.usage.cached_tokens = chunk.num_cached_tokens
    return response


def to_token_logprob(token_id: int, entry: messages.TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=token_id,
        logprob=entry.logprob,
        top_logprobs=[pb.TopLogprob(token_id=top.token_id, logprob=top.logprob) for top in entry.top],
    )


def to_server_info(reply: messages.InfoReply) -> pb.ServerInfoResponse:
    return pb.ServerInfoResponse(
        model_name=reply.model_name,
        max_model_len=reply.max_model_len,
        num_waiting=reply.num_waiting,
        num_running=reply.num_running,
        processes=[to_process(process) for process in reply.processes],
        speculation=to_speculation(reply.speculation) if reply.speculation else None,
    )


def to_speculation(spec: messages.SpeculationInfo) -> pb.Speculation:
    """Every counter the gRPC message holds (steps_by_k is in /metrics only)."""
    sources = [
        pb.SourceAcceptance(source=name, **msgspec.structs.asdict(entry)) for name, entry in spec.sources.items()
    ]
    return pb.Speculation(**{**_fields_for(pb.Speculation, spec), "sources": sources})


def to_process(process: messages.ProcessInfo) -> pb.Process:
    """Every field the gRPC message holds (protocol error counts are in /metrics only)."""
    return pb.Process(**{**_fields_for(pb.Process, process), "state": str(process.state)})


def _fields_for(message: type[Message], struct: msgspec.Struct) -> dict[str, Any]:
    return {name: getattr(struct, name) for name in message.DESCRIPTOR.fields_by_name}
