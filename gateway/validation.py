"""Checks a ClientRequest field by field and turns it into a Submission, or raises InvalidArgument naming the field.

The rules are written once for both public APIs; each front end passes its FieldNames, so
an error names the field as that client wrote it (`params.top_p` over gRPC, `top_p` over HTTP).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, assert_never

from gateway.errors import InvalidArgument
from gateway.request import ChatPrompt, ClientRequest, Prompt, Submission, TextPrompt, TokenPrompt
from common.text.structured import StructuredSpec
from common.text.tokenizer import ChatMessage
from proto import messages

MAX_REQUEST_ID_CHARS = 128
# Every stop string is looked for in every chunk of the output: a few short ones are cheap, tens of thousands slow
# every other request on the gateway. OpenAI documents up to 4; these leave room for clients that send more.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_CACHE_SALT_CHARS = 256
MAX_STOP_TOKEN_IDS = 256  # a client's own; with the model's eos ids, well under the scheduler's 1024
# Counts (max_tokens, top_k, min_tokens) are bounded as the gRPC API's int32 fields are, in every API; a seed below
# 2^64 is what the scheduler draws with. Every integer then fits the scheduler's message (msgpack holds < 2^64).
MAX_INT32 = 2**31 - 1
SEED_LIMIT = 2**64


@dataclass(frozen=True)
class FieldNames:
    """What one front end calls each field that `validate` checks. In a name for one item of a list,
    `{index}` stands for its position (a front end may leave it out)."""

    text_prompt: str
    chat: str  # the conversation as a whole (its template's errors)
    chat_messages: str
    chat_role: str  # one message's role: "{index}"
    token_ids: str
    token_id: str  # one prompt token: "{index}"
    max_tokens: str
    temperature: str
    top_p: str
    top_k: str
    min_p: str
    seed: str
    stop_strings: str  # the list as a whole
    stop_string: str  # "{index}"
    stop_token_id: str  # "{index}"
    logprobs: str
    prompt_logprobs: str
    presence_penalty: str
    frequency_penalty: str
    repetition_penalty: str
    logit_bias: str  # the map as a whole; one entry is named "<logit_bias>[<token id>]"
    min_tokens: str
    cache_salt: str = "cache_salt"  # the same name in every API
    priority: str = "priority"  # the same name in every API

    def of_prompt(self, prompt: Prompt) -> str:
        match prompt:
            case TextPrompt():
                return self.text_prompt
            case ChatPrompt():
                return self.chat
            case TokenPrompt():
                return self.token_ids
            case _:
                assert_never(prompt)


def checked_request_id(request_id: str, *, field: str) -> str:
    """A request id the client chose: 1 to MAX_REQUEST_ID_CHARS printable characters."""
    if not 1 <= len(request_id) <= MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(field, f"must be 1 to {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")
    if not request_id.isprintable():
        raise InvalidArgument(field, "must hold printable characters only")
    return request_id


class Grammars(Protocol):
    def grammar(self, asked: tuple[str, StructuredSpec]) -> str: ...


def validate(
    request: ClientRequest, *, fields: FieldNames, request_id: str, vocab_size: int, grammars: Grammars | None = None
) -> Submission:
    """Every field of the request checked; raises InvalidArgument for the first bad one. A structured-output ask
    is compiled by `grammars` (gateway/structured_request.py)."""
    check_prompt(request.prompt, fields, vocab_size)
    return Submission(
        request_id=request_id,
        prompt=request.prompt,
        prompt_field=fields.of_prompt(request.prompt),
        max_tokens=max_tokens_of(request.max_tokens, fields, scoring=request.prompt_logprobs is not None),
        sampling=sampling_of(request, fields, vocab_size),
        seed_given=request.seed is not None,
        stop_strings=stop_strings_of(request.stop_strings, fields),
        stop_token_ids=stop_token_ids_of(request.stop_token_ids, fields, vocab_size),
        ignore_eos=request.ignore_eos,
        logprobs=logprobs_of(request.logprobs, fields.logprobs),
        prompt_logprobs=logprobs_of(request.prompt_logprobs, fields.prompt_logprobs),
        grammar=grammar_of(request.structured, grammars),
        cache_salt=cache_salt_of(request.cache_salt, fields.cache_salt),
        priority=priority_of(request.priority, fields.priority),
        user=request.user,
    )


def priority_of(priority: int | None, field: str) -> int:
    """The request's priority (0 unset); within what the gRPC API's int32 holds. Whether the scheduler takes one
    other than 0 is its policy's to say."""
    if priority is None:
        return 0
    if not messages.MIN_PRIORITY <= _integer(priority, field) <= messages.MAX_PRIORITY:
        raise InvalidArgument(field, f"must be in [{messages.MIN_PRIORITY}, {messages.MAX_PRIORITY}], got {priority}")
    return priority


def cache_salt_of(salt: str | None, field: str) -> str | None:
    """A salt the client chose: 1 to MAX_CACHE_SALT_CHARS printable characters (it is logged nowhere)."""
    if salt is None:
        return None
    if not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise InvalidArgument(field, f"must be 1 to {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}")
    if not salt.isprintable():
        raise InvalidArgument(field, "must hold printable characters only")
    return salt


def grammar_of(structured: tuple[str, StructuredSpec] | None, grammars: Grammars | None) -> str | None:
    if structured is None:
        return None
    if grammars is None:
        raise InvalidArgument(structured[0], "structured output is not served here")
    return grammars.grammar(structured)


def logprobs_of(count: int | None, field: str) -> int | None:
    if count is not None and not 0 <= _integer(count, field) <= messages.MAX_TOP_LOGPROBS:
        raise InvalidArgument(field, f"must be 0 to {messages.MAX_TOP_LOGPROBS}, got {count}")
    return count


def check_prompt(prompt: Prompt, fields: FieldNames, vocab_size: int) -> None:
    match prompt:
        case TextPrompt(text=text):
            if not text:
                raise InvalidArgument(fields.text_prompt, "must not be empty")
        case ChatPrompt(messages=chat_messages):
            check_chat_messages(chat_messages, fields)
        case TokenPrompt(token_ids=token_ids):
            if not token_ids:
                raise InvalidArgument(fields.token_ids, "must not be empty")
            token_ids_in_vocab(fields.token_id, token_ids, vocab_size)
        case _:
            assert_never(prompt)


def check_chat_messages(chat_messages: Sequence[ChatMessage], fields: FieldNames) -> None:
    if not chat_messages:
        raise InvalidArgument(fields.chat_messages, "must hold at least one message")
    for index, message in enumerate(chat_messages):
        if not message.role:
            raise InvalidArgument(fields.chat_role.format(index=index), "must not be empty")


def token_ids_in_vocab(field: str, token_ids: Sequence[int], vocab_size: int) -> tuple[int, ...]:
    """token_ids as given, if each is an integer in [0, vocab_size) (a bool is not); `field` names one id
    ("{index}")."""
    for index, token_id in enumerate(token_ids):
        if type(token_id) is not int or not 0 <= token_id < vocab_size:
            raise InvalidArgument(field.format(index=index), _not_a_token(token_id, vocab_size))
    return tuple(token_ids)


def _not_a_token(token_id: object, vocab_size: int) -> str:
    if type(token_id) is not int:
        return f"must be a token id (an integer), got {type(token_id).__name__}"
    return f"token id {token_id} is outside the vocabulary [0, {vocab_size})"


def stop_token_ids_of(stop_token_ids: Sequence[int], fields: FieldNames, vocab_size: int) -> tuple[int, ...]:
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(
            fields.stop_token_id.format(index=MAX_STOP_TOKEN_IDS),
            f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(stop_token_ids)}",
        )
    return token_ids_in_vocab(fields.stop_token_id, stop_token_ids, vocab_size)


def max_tokens_of(max_tokens: int | None, fields: FieldNames, *, scoring: bool = False) -> int | None:
    """At least 1; 0 too when the prompt's log-probabilities are asked for (it is scored, nothing is generated)."""
    least = 0 if scoring else 1
    if max_tokens is None:
        return None
    if _integer(max_tokens, fields.max_tokens) < least:
        raise InvalidArgument(fields.max_tokens, f"must be at least {least}, got {max_tokens}")
    if max_tokens > MAX_INT32:
        raise InvalidArgument(fields.max_tokens, f"must be at most {MAX_INT32}, got {max_tokens}")
    return max_tokens


def sampling_of(request: ClientRequest, fields: FieldNames, vocab_size: int) -> messages.SamplingParams:
    defaults = messages.SamplingParams()
    temperature = (
        defaults.temperature if request.temperature is None else _real(request.temperature, fields.temperature)
    )
    top_p = defaults.top_p if request.top_p is None else _real(request.top_p, fields.top_p)
    top_k = defaults.top_k if request.top_k is None else _integer(request.top_k, fields.top_k)
    min_p = defaults.min_p if request.min_p is None else _real(request.min_p, fields.min_p)
    seed = defaults.seed if request.seed is None else _integer(request.seed, fields.seed)
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise InvalidArgument(fields.temperature, f"must be finite and >= 0, got {temperature}")
    if temperature > messages.MAX_TEMPERATURE:
        raise InvalidArgument(fields.temperature, f"must be at most {messages.MAX_TEMPERATURE:g}, got {temperature}")
    if not 0.0 < top_p <= 1.0:  # also false for NaN
        raise InvalidArgument(fields.top_p, f"must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise InvalidArgument(fields.top_k, f"must be >= 0 (0 = no top-k cut), got {top_k}")
    if top_k > MAX_INT32:
        raise InvalidArgument(fields.top_k, f"must be at most {MAX_INT32}, got {top_k}")
    if not 0.0 <= min_p <= 1.0:  # also false for NaN
        raise InvalidArgument(fields.min_p, f"must be in [0, 1], got {min_p}")
    if not 0 <= seed < SEED_LIMIT:
        raise InvalidArgument(fields.seed, f"must be in [0, 2^64), got {seed}")
    return messages.SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        penalties=penalties_of(request, fields, vocab_size),
    )


def penalties_of(request: ClientRequest, fields: FieldNames, vocab_size: int) -> messages.Penalties | None:
    """The request's penalties, None when it asks for none (the logits as the model gives them)."""
    presence = _penalty(request.presence_penalty, fields.presence_penalty)
    frequency = _penalty(request.frequency_penalty, fields.frequency_penalty)
    repetition = (
        1.0 if request.repetition_penalty is None else _real(request.repetition_penalty, fields.repetition_penalty)
    )
    least, most = messages.MIN_REPETITION_PENALTY, messages.MAX_REPETITION_PENALTY
    if not (math.isfinite(repetition) and least <= repetition <= most):
        raise InvalidArgument(fields.repetition_penalty, f"must be in [{least:g}, {most:g}], got {repetition}")
    if len(request.logit_bias) > messages.MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgument(
            fields.logit_bias, f"at most {messages.MAX_LOGIT_BIAS_ENTRIES} entries, got {len(request.logit_bias)}"
        )
    for token, bias in request.logit_bias:
        if type(token) is not int or not 0 <= token < vocab_size:
            raise InvalidArgument(f"{fields.logit_bias}[{token}]", _not_a_token(token, vocab_size))
        bias = _real(bias, f"{fields.logit_bias}[{token}]")
        if not (math.isfinite(bias) and -messages.MAX_LOGIT_BIAS <= bias <= messages.MAX_LOGIT_BIAS):
            raise InvalidArgument(
                f"{fields.logit_bias}[{token}]",
                f"must be in [-{messages.MAX_LOGIT_BIAS:g}, {messages.MAX_LOGIT_BIAS:g}], got {bias}",
            )
    min_tokens = 0 if request.min_tokens is None else _integer(request.min_tokens, fields.min_tokens)
    if not 0 <= min_tokens <= MAX_INT32:
        raise InvalidArgument(
            fields.min_tokens,
            f"must be >= 0, got {min_tokens}" if min_tokens < 0 else f"must be at most {MAX_INT32}, got {min_tokens}",
        )
    if request.max_tokens is not None and min_tokens > request.max_tokens:
        raise InvalidArgument(fields.min_tokens, f"must be at most max_tokens ({request.max_tokens}), got {min_tokens}")
    penalties = messages.Penalties(
        presence=presence,
        frequency=frequency,
        repetition=repetition,
        logit_bias=dict(request.logit_bias),
        min_tokens=min_tokens,
    )
    return None if penalties == messages.Penalties() else penalties


def _penalty(value: float | None, field: str) -> float:
    limit = messages.MAX_PENALTY
    if value is None:
        return 0.0
    if not (math.isfinite(value := _real(value, field)) and -limit <= value <= limit):
        raise InvalidArgument(field, f"must be in [-{limit:g}, {limit:g}], got {value}")
    return value


# A front end passes each value as its wire gave it. One that passed a float or a bool where an integer belongs, or a
# string where a number does, would make a message the scheduler cannot read (it drops it, and the client waits
# forever): every value's type is checked here too, so such a slip is a 400 naming the field.


def _integer(value: int, field: str) -> int:
    if type(value) is not int:  # a bool is an int to isinstance
        raise InvalidArgument(field, f"must be an integer, got {type(value).__name__}")
    return value


def _real(value: float, field: str) -> float:
    """The value as a float; an integer past a float's range is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(field, f"must be a number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError as error:
        raise InvalidArgument(field, f"is out of range: {error}") from error


def stop_strings_of(stop_strings: Sequence[str], fields: FieldNames) -> tuple[str, ...]:
    """At most MAX_STOP_STRINGS, each 1 to MAX_STOP_STRING_CHARS characters."""
    if len(stop_strings) > MAX_STOP_STRINGS:
        raise InvalidArgument(fields.stop_strings, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop_strings)}")
    for index, stop in enumerate(stop_strings):
        if not stop:
            raise InvalidArgument(fields.stop_string.format(index=index), "must not be empty")
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidArgument(
                fields.stop_string.format(index=index),
                f"must be at most {MAX_STOP_STRING_CHARS} characters, got {len(stop)}",
            )
    return tuple(stop_strings)
