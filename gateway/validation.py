"""Checks a GenerateRequest field by field and turns it into a Submission, or raises InvalidArgument naming the field."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.errors import InvalidArgument
from gateway.tokenizer import ChatMessage
from proto import messages
from proto import specserve_pb2 as pb

MAX_REQUEST_ID_CHARS = 128


@dataclass(frozen=True)
class TextPrompt:
    text: str


@dataclass(frozen=True)
class ChatPrompt:
    messages: tuple[ChatMessage, ...]


@dataclass(frozen=True)
class TokenPrompt:
    token_ids: tuple[int, ...]


Prompt = TextPrompt | ChatPrompt | TokenPrompt


@dataclass(frozen=True)
class Submission:
    """A request that passed every check; only tokenization is left before it goes to the scheduler."""

    request_id: str
    prompt: Prompt
    max_tokens: int | None  # None: until a stop condition or the context is full
    sampling: messages.SamplingParams
    seed_given: bool  # False: sampling.seed is 0 and the scheduler draws one
    stop_strings: tuple[str, ...]
    stop_token_ids: tuple[int, ...]  # the client's own, eos not included
    ignore_eos: bool

    def to_submit_request(self, prompt_token_ids: list[int], eos_token_ids: Sequence[int]) -> messages.SubmitRequest:
        """The scheduler's message: eos ids stop the request unless ignore_eos, then the client's stop ids."""
        stop_ids = [] if self.ignore_eos else list(eos_token_ids)
        return messages.SubmitRequest(
            request_id=self.request_id,
            prompt_token_ids=prompt_token_ids,
            max_tokens=self.max_tokens,
            sampling=self.sampling,
            stop_token_ids=list(dict.fromkeys([*stop_ids, *self.stop_token_ids])),
            seed_given=self.seed_given,
        )


def request_id_of(request: pb.GenerateRequest, generated_id: str) -> str:
    """The client's request_id when it set one (checked), else generated_id."""
    if not request.HasField("request_id"):
        return generated_id
    request_id = request.request_id
    if not 1 <= len(request_id) <= MAX_REQUEST_ID_CHARS:
        raise InvalidArgument("request_id", f"must be 1 to {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")
    if not request_id.isprintable():
        raise InvalidArgument("request_id", "must hold printable characters only")
    return request_id


def validate(request: pb.GenerateRequest, *, request_id: str, vocab_size: int) -> Submission:
    """Every field of the request checked; raises InvalidArgument for the first bad one."""
    params = request.params
    return Submission(
        request_id=request_id,
        prompt=prompt_of(request, vocab_size),
        max_tokens=max_tokens_of(params),
        sampling=sampling_of(params),
        seed_given=params.HasField("seed"),
        stop_strings=stop_strings_of(params),
        stop_token_ids=token_ids_in_vocab("params.stop_token_ids", params.stop_token_ids, vocab_size),
        ignore_eos=params.ignore_eos,
    )


def prompt_of(request: pb.GenerateRequest, vocab_size: int) -> Prompt:
    match request.WhichOneof("input"):
        case "prompt":
            if not request.prompt:
                raise InvalidArgument("prompt", "must not be empty")
            return TextPrompt(request.prompt)
        case "chat":
            return ChatPrompt(chat_messages_of(request.chat))
        case "token_ids":
            if not request.token_ids.ids:
                raise InvalidArgument("token_ids.ids", "must not be empty")
            return TokenPrompt(token_ids_in_vocab("token_ids.ids", request.token_ids.ids, vocab_size))
        case _:
            raise InvalidArgument("input", "set one of prompt, chat or token_ids")


def chat_messages_of(chat: pb.ChatMessages) -> tuple[ChatMessage, ...]:
    if not chat.messages:
        raise InvalidArgument("chat.messages", "must hold at least one message")
    for index, message in enumerate(chat.messages):
        if not message.role:
            raise InvalidArgument(f"chat.messages[{index}].role", "must not be empty")
    return tuple(ChatMessage(role=message.role, content=message.content) for message in chat.messages)


def token_ids_in_vocab(field: str, token_ids: Sequence[int], vocab_size: int) -> tuple[int, ...]:
    for index, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidArgument(f"{field}[{index}]", f"token id {token_id} is outside the vocabulary [0, {vocab_size})")
    return tuple(token_ids)


def max_tokens_of(params: pb.SamplingParams) -> int | None:
    if not params.HasField("max_tokens"):
        return None
    if params.max_tokens < 1:
        raise InvalidArgument("params.max_tokens", f"must be at least 1, got {params.max_tokens}")
    return params.max_tokens


def sampling_of(params: pb.SamplingParams) -> messages.SamplingParams:
    defaults = messages.SamplingParams()
    temperature = params.temperature if params.HasField("temperature") else defaults.temperature
    top_p = params.top_p if params.HasField("top_p") else defaults.top_p
    top_k = params.top_k if params.HasField("top_k") else defaults.top_k
    seed = params.seed if params.HasField("seed") else defaults.seed
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise InvalidArgument("params.temperature", f"must be finite and >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:  # also false for NaN
        raise InvalidArgument("params.top_p", f"must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise InvalidArgument("params.top_k", f"must be >= 0 (0 = no top-k cut), got {top_k}")
    if seed < 0:
        raise InvalidArgument("params.seed", f"must be >= 0, got {seed}")
    return messages.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)


def stop_strings_of(params: pb.SamplingParams) -> tuple[str, ...]:
    for index, stop in enumerate(params.stop):
        if not stop:
            raise InvalidArgument(f"params.stop[{index}]", "must not be empty")
    return tuple(params.stop)
