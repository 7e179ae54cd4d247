"""One request's stream over the scheduler link: its states, its messages in order, resumption after a reconnect.

The link itself (`gateway.scheduler_client.SchedulerClient`) routes each TokenDelta and
RequestError here by the id the scheduler knows the request by; a stream needs of it only
the few calls in `SchedulerLink`.
"""

from __future__ import annotations

import asyncio
import enum
from types import TracebackType
from typing import Protocol, assert_never

import msgspec

from common.logs import get_logger
from gateway.errors import SchedulerUnavailable, UnreadableRequest
from proto import messages

# A stream that has heard nothing for this long checks that the scheduler still answers.
STREAM_LIVENESS_CHECK_S = 5.0

RequestMessage = messages.TokenDelta | messages.RequestError
_SCHEDULER_DECODER = msgspec.msgpack.Decoder(
    messages.GatewayToScheduler
)  # as strict as the scheduler's (check_readable)


class StreamState(enum.Enum):
    OPEN = "open"  # registered, not submitted yet
    SUBMITTED = "submitted"
    FINISHED = "finished"  # the scheduler sent the last delta
    FAILED = "failed"  # the scheduler sent a RequestError
    ABORTED = "aborted"  # the gateway sent an AbortRequest


# A stream in one of these states gets nothing more from the scheduler.
TERMINAL_STATES = frozenset({StreamState.FINISHED, StreamState.FAILED, StreamState.ABORTED})


class SchedulerLink(Protocol):
    """What a stream asks of the gateway's link to the scheduler (`SchedulerClient`)."""

    async def send(self, message: messages.GatewayToScheduler) -> None: ...

    def new_scheduler_id(self) -> str: ...

    async def wait_reachable(self) -> None: ...

    def close_request(self, stream: RequestStream) -> None: ...


class RequestStream:
    """One request's conversation with the scheduler: submit, read messages in order, maybe abort.

    Use as `async with`: leaving the block unregisters the request and, if the scheduler
    has not ended it, sends an AbortRequest ("client_cancelled" when the block was left by
    cancellation, "gateway_error" when by another exception).

    When the connection to the scheduler comes back after a drop, a request still running
    goes on from the tokens it has received: the scheduler is sent its prompt plus those
    tokens under a new id (`resumption`), and what comes back reads as the same stream,
    its speculation counts continued. Greedy and seeded requests get the very tokens an
    uninterrupted run gives (a draw depends only on its seed and position).
    """

    def __init__(self, client: SchedulerLink, request_id: str, scheduler_id: str) -> None:
        self.request_id = request_id  # the client's
        self.scheduler_id = scheduler_id  # the id the scheduler knows it by (another after a resumption)
        self._client = client
        self._queue: asyncio.Queue[RequestMessage] = asyncio.Queue()
        self._state = StreamState.OPEN
        self._submitted: messages.SubmitRequest | None = None
        self._received: list[int] = []  # every token the scheduler sent so far
        self._ended = False  # the scheduler's last message for it arrived
        self._spec_before = (0, 0, 0)  # speculation counts of the schedulers before a resumption
        self._spec_now = (0, 0, 0)
        self._num_cached_tokens = 0  # of the prompt the client sent: the first scheduler's word
        self._num_resumptions = 0
        self._num_prompt_scored = 0  # prompt log-probabilities passed on
        self._num_prompt_scored_in_run = 0  # of those, the ones the current scheduler run sent (or sent again)
        self._log = get_logger(component="request_stream")

    @property
    def state(self) -> StreamState:
        return self._state

    async def submit(self, request: messages.SubmitRequest) -> None:
        self._require_state(StreamState.OPEN, "submit")
        request = msgspec.structs.replace(request, request_id=self.scheduler_id)
        check_readable(request)  # before the state moves: a request never sent is never aborted
        self._state = StreamState.SUBMITTED
        self._submitted = request
        self._log.info("request.submitted", request_id=self.request_id, scheduler_id=self.scheduler_id)
        await self._client.send(request)

    def deliver(self, message: RequestMessage) -> None:
        """A message from the scheduler, as the stream's reader will see it."""
        match message:
            case messages.TokenDelta():
                self._received.extend(message.token_ids)
                if message.prompt_logprobs:  # a request resumed before its first token is scored again from the start
                    entries = message.prompt_logprobs
                    new = entries[max(0, self._num_prompt_scored - self._num_prompt_scored_in_run) :]
                    self._num_prompt_scored_in_run += len(entries)
                    self._num_prompt_scored += len(new)
                    message = msgspec.structs.replace(message, prompt_logprobs=new or None)
                before = self._spec_before
                self._spec_now = (
                    before[0] + message.num_draft_tokens,
                    before[1] + message.num_accepted_draft_tokens,
                    before[2] + message.num_verify_steps,
                )
                if self._num_resumptions:
                    assert self._submitted is not None  # only a submitted request is resumed
                    message = msgspec.structs.replace(
                        message,
                        request_id=self.request_id,
                        num_completion_tokens=len(self._received),
                        num_prompt_tokens=len(self._submitted.prompt_token_ids),
                        num_draft_tokens=self._spec_now[0],
                        num_accepted_draft_tokens=self._spec_now[1],
                        num_verify_steps=self._spec_now[2],
                        num_cached_tokens=self._num_cached_tokens,
                    )
                else:
                    self._num_cached_tokens = message.num_cached_tokens
                    message = msgspec.structs.replace(message, request_id=self.request_id)
                self._ended = message.finish_reason is not None
            case messages.RequestError():
                message = msgspec.structs.replace(message, request_id=self.request_id)
                self._ended = True
            case _:
                assert_never(message)
        self._queue.put_nowait(message)

    def resumption(self) -> tuple[messages.AbortRequest, messages.SubmitRequest] | None:
        """For a request still running: the abort of the id the scheduler knew and the request that goes on from
        the tokens received, under a new id (the stream now answers to it); None for any other."""
        submitted = self._submitted
        if self._state is not StreamState.SUBMITTED or self._ended or submitted is None:
            return None
        abort = messages.AbortRequest(request_id=self.scheduler_id, reason="scheduler_reconnected")
        self._num_resumptions += 1
        self.scheduler_id = self._client.new_scheduler_id()
        self._spec_before = self._spec_now
        self._num_prompt_scored_in_run = 0
        max_tokens = None if submitted.max_tokens is None else submitted.max_tokens - len(self._received)
        # Once a token came, the prompt's log-probabilities have all come; those received before are not sent twice.
        submit = msgspec.structs.replace(
            submitted,
            request_id=self.scheduler_id,
            prompt_token_ids=submitted.prompt_token_ids + self._received,
            max_tokens=max_tokens,
            resumed_tokens=submitted.resumed_tokens + len(self._received),
            prompt_logprobs=None if self._received else submitted.prompt_logprobs,
        )
        self._log.info("request.resumed", request_id=self.request_id, num_tokens_received=len(self._received))
        return abort, submit

    async def next(self) -> RequestMessage:
        """The next TokenDelta or RequestError; raises SchedulerUnavailable if the scheduler stops answering."""
        self._require_state(StreamState.SUBMITTED, "next")
        while True:
            try:
                async with asyncio.timeout(STREAM_LIVENESS_CHECK_S):
                    message = await self._queue.get()
            except TimeoutError:
                await self._client.wait_reachable()
                continue
            self._state = next_state(message)
            return message

    async def abort(self, reason: str) -> None:
        """Tell the scheduler to stop the request; nothing is sent if it has already ended."""
        if self._state in TERMINAL_STATES:
            return
        submitted = self._state is StreamState.SUBMITTED
        self._state = StreamState.ABORTED
        if submitted:
            await self._client.send(messages.AbortRequest(request_id=self.scheduler_id, reason=reason))
            self._log.info("request.aborted", request_id=self.request_id, reason=reason)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._client.close_request(self)
        cancelled = exc_type is not None and issubclass(exc_type, asyncio.CancelledError | GeneratorExit)
        try:
            await self.abort("client_cancelled" if cancelled else "gateway_error")
        except SchedulerUnavailable as error:  # the request is over for the client either way
            self._log.warning("request.abort_not_sent", request_id=self.request_id, error=error.message)

    def _require_state(self, expected: StreamState, action: str) -> None:
        if self._state is not expected:
            raise RuntimeError(f"RequestStream.{action} in state {self._state.value}, expected {expected.value}")


def check_readable(submit: messages.SubmitRequest) -> None:
    """Raises UnreadableRequest if the scheduler could not read `submit` (a float or a bool where an integer belongs,
    an integer past 64 bits): it would count it as malformed and drop it without an answer, and the client would wait
    for ever. Decoded as the scheduler decodes it, so a slip in the checks before cannot go unseen."""
    try:
        _SCHEDULER_DECODER.decode(msgspec.msgpack.encode(submit))
    except (msgspec.DecodeError, OverflowError, TypeError) as error:  # DecodeError: ValidationError too
        raise UnreadableRequest(
            f"the gateway built a request the scheduler cannot read ({error}); it was not sent"
        ) from error


def next_state(message: RequestMessage) -> StreamState:
    """The stream's state after the scheduler sent message."""
    match message:
        case messages.TokenDelta(finish_reason=None):
            return StreamState.SUBMITTED
        case messages.TokenDelta():
            return StreamState.FINISHED
        case messages.RequestError():
            return StreamState.FAILED
        case _:
            assert_never(message)
