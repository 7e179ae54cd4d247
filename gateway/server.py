"""The SpecServe gRPC servicer: validate, tokenize, submit to the scheduler, stream the output back."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import assert_never

import grpc
import structlog

from common.logs import get_logger
from gateway.errors import InvalidArgument, RequestFailed
from gateway.output import Chunk, RequestOutput, SpecUsage
from gateway.scheduler_client import RequestStream, SchedulerClient
from gateway.tokenizer import Tokenizer
from gateway.validation import ChatPrompt, Prompt, Submission, TextPrompt, TokenPrompt, request_id_of, validate
from proto import messages
from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc

FINISH_REASONS: dict[messages.FinishReason, pb.FinishReason] = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


class SpecServeServicer(pb_grpc.SpecServeServicer):
    """Generate and GetServerInfo; every request's log lines carry its request_id."""

    def __init__(self, tokenizer: Tokenizer, scheduler: SchedulerClient) -> None:
        self._tokenizer = tokenizer
        self._scheduler = scheduler
        self._log = get_logger(component="servicer")

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Server-streaming: chunks are written with context.write so cancellation lands in this task."""
        started_at = time.monotonic()
        try:
            request_id = request_id_of(request, generated_id=uuid.uuid4().hex)
            # Each RPC runs in its own task with its own context: this binding ends with the request.
            structlog.contextvars.bind_contextvars(request_id=request_id)
            await self._generate(request, request_id, context)
        except RequestFailed as error:
            self._log.info("request.failed", status=error.status.name, message=error.message)
            await context.abort(error.status, error.message)
        except asyncio.CancelledError:
            self._log.info("request.cancelled", duration_s=round(time.monotonic() - started_at, 3))
            raise
        except Exception as error:  # recoverable: this request fails, the gateway lives on
            self._log.exception("request.internal_error", error_type=type(error).__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in the gateway: {type(error).__name__}")

    async def GetServerInfo(self, request: pb.ServerInfoRequest, context: grpc.aio.ServicerContext) -> pb.ServerInfoResponse:
        try:
            return to_server_info(await self._scheduler.query_info())
        except RequestFailed as error:
            await context.abort(error.status, error.message)
            raise  # not reached: abort raises

    async def _generate(self, request: pb.GenerateRequest, request_id: str, context: grpc.aio.ServicerContext) -> None:
        started_at = time.monotonic()
        submission = validate(request, request_id=request_id, vocab_size=self._tokenizer.vocab_size)
        prompt_token_ids = await asyncio.to_thread(self._tokenize, submission.prompt)
        submit = submission.to_submit_request(prompt_token_ids, self._tokenizer.eos_token_ids)
        output = RequestOutput(self._tokenizer, prompt_token_ids, submission.stop_strings)
        self._log_received(submission, submit)
        async with self._scheduler.open_request(request_id) as stream:
            await self._scheduler.ensure_reachable()
            await stream.submit(submit)
            while (chunk := await self._next_chunk(stream, output)).finish_reason is None:
                await write_chunk(context, chunk, request_id)
            if chunk.stop_string is not None:
                await stream.abort("stop_string")  # sends nothing if the scheduler had finished anyway
            await write_chunk(context, chunk, request_id)
        self._log.info(
            "request.finished",
            finish_reason=chunk.finish_reason,
            stop_string=chunk.stop_string,
            num_prompt_tokens=chunk.num_prompt_tokens,
            num_completion_tokens=chunk.num_completion_tokens,
            num_draft_tokens=chunk.speculation.num_draft_tokens,
            num_accepted_draft_tokens=chunk.speculation.num_accepted_draft_tokens,
            duration_s=round(time.monotonic() - started_at, 3),
        )

    async def _next_chunk(self, stream: RequestStream, output: RequestOutput) -> Chunk:
        """Read scheduler messages until one yields something to send (text, ids or the finish)."""
        while True:
            message = await stream.next()
            if isinstance(message, messages.RequestError):
                raise RequestFailed.from_scheduler(message)
            speculation = SpecUsage(message.num_draft_tokens, message.num_accepted_draft_tokens, message.num_verify_steps)
            chunk = output.add(message.token_ids, message.finish_reason, speculation)
            if chunk.text or chunk.token_ids or chunk.finish_reason is not None:
                return chunk

    def _tokenize(self, prompt: Prompt) -> list[int]:
        match prompt:
            case TextPrompt(text=text):
                token_ids = self._tokenizer.encode(text)
            case ChatPrompt(messages=chat_messages):
                token_ids = self._tokenizer.encode_chat(chat_messages)
            case TokenPrompt(token_ids=ids):
                token_ids = list(ids)
            case _:
                assert_never(prompt)
        if not token_ids:
            raise InvalidArgument("prompt", "tokenizes to no tokens")
        return token_ids

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
        )


async def write_chunk(context: grpc.aio.ServicerContext, chunk: Chunk, request_id: str) -> None:
    await context.write(to_response(chunk, request_id))


def to_response(chunk: Chunk, request_id: str) -> pb.GenerateResponse:
    response = pb.GenerateResponse(text=chunk.text, token_ids=chunk.token_ids, request_id=request_id)
    if chunk.finish_reason is not None:
        response.finish_reason = FINISH_REASONS[chunk.finish_reason]
        response.usage.prompt_tokens = chunk.num_prompt_tokens
        response.usage.completion_tokens = chunk.num_completion_tokens
        response.usage.draft_tokens = chunk.speculation.num_draft_tokens
        response.usage.accepted_draft_tokens = chunk.speculation.num_accepted_draft_tokens
        response.usage.verify_steps = chunk.speculation.num_verify_steps
    return response


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
    return pb.Speculation(
        num_draft_tokens=spec.num_draft_tokens,
        num_accepted_draft_tokens=spec.num_accepted_draft_tokens,
        num_verify_steps=spec.num_verify_steps,
        num_plain_decode_steps=spec.num_plain_decode_steps,
        acceptance_rate=spec.acceptance_rate,
        mean_accepted_length=spec.mean_accepted_length,
    )


def to_process(process: messages.ProcessInfo) -> pb.Process:
    return pb.Process(
        process_id=process.process_id,
        role=process.role,
        state=process.state,
        incarnation=process.incarnation,
        heartbeat_age_s=process.heartbeat_age_s,
        num_used_kv_slots=process.num_used_kv_slots,
        num_kv_slots=process.num_kv_slots,
        num_running=process.num_running,
        failure=process.failure,
    )
