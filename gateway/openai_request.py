"""The HTTP API's side of a request: an OpenAI completions or chat body to a ClientRequest, and the body's field names.

Here only what JSON can get wrong is checked (a string where a number belongs, a parameter
this server does not implement); the values are checked by `validation.validate`, as for
gRPC, with OPENAI_FIELDS, so every error names the body's own field. A completion's prompts
are read here, a chat's messages in openai_chat_prompt.py.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from gateway.api_error import ApiError
from gateway.request import ClientRequest, Prompt, TextPrompt, TokenPrompt
from gateway.structured_request import Asked, SpecError, openai_structured
from gateway.validation import FieldNames

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# The body fields each endpoint reads: OpenAI's own and the extensions vLLM added that are implemented here. `user`
# (OpenAI's id of the client's own end user) is taken and changes nothing, as at OpenAI.
_BOTH_FIELDS = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "n",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "logprobs",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "response_format",
        "user",
        # vLLM's extensions
        "top_k",
        "min_p",
        "priority",
        "stop_token_ids",
        "ignore_eos",
        "repetition_penalty",
        "min_tokens",
        "structured_outputs",
        "cache_salt",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    }
)
COMPLETION_FIELDS = _BOTH_FIELDS | {"prompt", "best_of", "echo"}
CHAT_FIELDS = _BOTH_FIELDS | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "chat_template_kwargs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}
# Fields of OpenAI's (and vLLM's) bodies this server does not implement, with the values that ask for nothing. Any
# other value, and any field neither here nor read, is refused naming the field: dropped without a word it would
# change the output the client expects (tools offered, and a plain answer back).
UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "parallel_tool_calls": (True, False),  # what it says matters only with tools, which are refused
}
MAX_CHOICES = 64  # requests one answer runs: prompts times best_of (or n)
MAX_LOGIT_BIAS_KEY_CHARS = 12  # a token id as a JSON key
MAX_PROMPTS = 64  # prompts in one /v1/completions request (each is a request of its own, a choice of the answer)
_INT32_MAX = 2**31 - 1  # max_tokens and top_k: what the gRPC API's int32 fields hold
# A token id as a logit_bias key: ASCII digits only (str.isdigit takes "²", which int() refuses), a sign allowed.
_TOKEN_ID_KEY = re.compile("-?[0-9]+")

# A token prompt's errors name `prompt`, not one of its items; chat requests may name max_completion_tokens instead.
OPENAI_FIELDS = FieldNames(
    text_prompt="prompt",
    chat="messages",
    chat_messages="messages",
    chat_role="messages[{index}].role",
    token_ids="prompt",
    token_id="prompt",
    max_tokens="max_tokens",
    temperature="temperature",
    top_p="top_p",
    top_k="top_k",
    min_p="min_p",
    seed="seed",
    stop_strings="stop",
    stop_string="stop[{index}]",
    stop_token_id="stop_token_ids[{index}]",
    logprobs="logprobs",
    prompt_logprobs="logprobs",
    presence_penalty="presence_penalty",
    frequency_penalty="frequency_penalty",
    repetition_penalty="repetition_penalty",
    logit_bias="logit_bias",
    min_tokens="min_tokens",
)


def completion_prompts(body: dict[str, Any]) -> list[Prompt]:
    """/v1/completions' `prompt`: a string or a list of token ids, or a list of either (a choice for each, in order)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and _is_token_ids(prompt)):
        return [_one_prompt(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise ApiError(
                400, f"prompt holds {len(prompt)} prompts, at most {MAX_PROMPTS} are served at once", "prompt"
            )
        return [_one_prompt(p) for p in prompt]
    raise ApiError(400, "prompt must be a string or a list of token ids, or a list of those", "prompt")


def _is_token_ids(value: object) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _one_prompt(prompt: str | list[int]) -> Prompt:
    return TextPrompt(prompt) if isinstance(prompt, str) else TokenPrompt(tuple(prompt))


def client_request_of(body: dict[str, Any], prompt: Prompt, *, chat: bool) -> tuple[ClientRequest, FieldNames]:
    """The prompt with the body's parameters, and the names to check them by; raises ApiError for a parameter of
    the wrong type or one this server does not implement (in this order, the first wrong one)."""
    check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    _string_param("user", body.get("user"))
    max_tokens_as, max_tokens = _max_tokens_field(body, chat=chat)
    top_k, seed = body.get("top_k"), body.get("seed")
    checked_max_tokens = _int_param(max_tokens_as, max_tokens, at_most=_INT32_MAX)
    temperature = _float_param("temperature", body.get("temperature"))
    top_p = _float_param("top_p", body.get("top_p"))
    checked_top_k = _int_param("top_k", None if top_k == -1 else top_k, at_most=_INT32_MAX)  # -1: no cut, as in vLLM
    checked_seed = _int_param("seed", seed % 2**63 if isinstance(seed, int) and not isinstance(seed, bool) else seed)
    stop_strings = _stop_strings(body.get("stop"))
    logprobs = (
        _chat_logprobs(body)
        if chat
        else _int_param("logprobs", None if body.get("logprobs") is False else body.get("logprobs"))
    )
    echo = not chat and _bool_param("echo", body.get("echo"))
    # An echoed prompt comes with its log-probabilities when they are asked; max_tokens 0 then scores it alone.
    scores_only = checked_max_tokens is not None and checked_max_tokens <= 0
    prompt_logprobs = logprobs if echo and logprobs is not None else 0 if echo and scores_only else None
    request = ClientRequest(
        prompt=prompt,
        max_tokens=checked_max_tokens,
        temperature=1.0 if temperature is None else temperature,  # OpenAI's default
        top_p=top_p,
        top_k=checked_top_k,
        min_p=_float_param("min_p", body.get("min_p")),  # an extension, as in vLLM
        seed=checked_seed,
        stop_strings=stop_strings,
        stop_token_ids=token_ids_param("stop_token_ids", body.get("stop_token_ids")),  # an extension, as in vLLM
        ignore_eos=_bool_param("ignore_eos", body.get("ignore_eos")),  # an extension, as in vLLM
        user=body.get("user"),  # checked a string above
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=_float_param("presence_penalty", body.get("presence_penalty")),
        frequency_penalty=_float_param("frequency_penalty", body.get("frequency_penalty")),
        repetition_penalty=_float_param(
            "repetition_penalty", body.get("repetition_penalty")
        ),  # an extension, as in vLLM
        logit_bias=_logit_bias(body.get("logit_bias")),
        min_tokens=_int_param("min_tokens", body.get("min_tokens"), at_most=_INT32_MAX),  # an extension, as in vLLM
        structured=_structured(body),
        cache_salt=_string_param("cache_salt", body.get("cache_salt")),  # an extension, as in vLLM
        priority=_int_param("priority", body.get("priority")),  # an extension, as in vLLM
    )
    return request, dataclasses.replace(
        OPENAI_FIELDS, max_tokens=max_tokens_as, logprobs="top_logprobs" if chat else "logprobs"
    )


def check_fields(body: dict[str, Any], known: frozenset[str]) -> None:
    """Raises ApiError naming the first field of the body that is neither read (`known`) nor, at a value that asks for
    nothing, one of the UNSUPPORTED ones; a field sent as null counts as not sent."""
    for name, value in body.items():
        if name in known or value is None:
            continue
        harmless = UNSUPPORTED.get(name)
        if harmless is None:
            raise ApiError(400, f"{name} is not supported by this server", name)
        if not any(value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in harmless):
            raise ApiError(400, f"{name} is not supported by this server (only {harmless[0]!r})", name)


@dataclass(frozen=True)
class ChoiceCounts:
    n: int  # choices per prompt in the answer
    best_of: int  # requests run per prompt, the n best returned

    @property
    def ranks(self) -> bool:
        return self.best_of > self.n


def choice_counts(body: dict[str, Any], *, chat: bool, stream: bool, num_prompts: int) -> ChoiceCounts:
    """`n` choices of each prompt, the best of `best_of` (completions only; not streamed, since the best are known only
    at the end)."""
    asked = _int_param("n", body.get("n"))
    n = 1 if asked is None else asked
    best_of = _int_param("best_of", body.get("best_of"))
    if n < 1:
        raise ApiError(400, f"n must be at least 1, got {n}", "n")
    if best_of is not None and chat:
        raise ApiError(400, "best_of is for /v1/completions", "best_of")
    best_of = n if best_of is None else best_of
    if best_of < n:
        raise ApiError(400, f"best_of ({best_of}) must be at least n ({n})", "best_of")
    if best_of > n and stream:
        raise ApiError(400, "best_of greater than n cannot be streamed", "best_of")
    if num_prompts * best_of > MAX_CHOICES:
        raise ApiError(
            400,
            f"{num_prompts} prompts times {best_of} choices each is more than the {MAX_CHOICES} "
            "this server runs for one request",
            "best_of" if best_of > n else "n",
        )
    return ChoiceCounts(n, best_of)


def token_ids_param(name: str, value: object) -> tuple[int, ...]:
    """A list of token ids (their range is checked by `validate`, which names the item)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ApiError(400, f"{name} must be a list of token ids", name)
    return tuple(value)


def _string_param(name: str, value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"{name} must be a string", name)
    return value


def _structured(body: dict[str, Any]) -> Asked | None:
    try:
        return openai_structured(body)
    except SpecError as error:
        raise ApiError(400, f"{error.field}: {error}", error.field) from error


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token ids (as strings: JSON keys) to biases."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ApiError(400, "logit_bias must be an object of token ids to numbers", "logit_bias")
    entries = []
    for key, bias in value.items():
        name = f"logit_bias[{key}]"
        if len(key) > MAX_LOGIT_BIAS_KEY_CHARS or not _TOKEN_ID_KEY.fullmatch(key):
            raise ApiError(400, f"{name}: the key must be a token id", "logit_bias")
        checked = _float_param(name, bias)
        if checked is None:
            raise ApiError(400, f"{name} must be a number", name)
        entries.append((int(key), checked))
    return tuple(entries)


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat asks with `logprobs: true`, and for alternatives with `top_logprobs` (which needs it)."""
    wanted = _bool_param("logprobs", body.get("logprobs"))
    top = _int_param("top_logprobs", body.get("top_logprobs"))
    if top is not None and not wanted:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def _bool_param(name: str, value: object) -> bool:
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a boolean", name)
    return value is True


def _max_tokens_field(body: dict[str, Any], *, chat: bool) -> tuple[str, object]:
    """Which field gives the completion's length, as the client named it, and its value (chat: the newer
    max_completion_tokens, else max_tokens; a field sent as null counts as not sent)."""
    if not chat:
        return "max_tokens", body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if body.get("max_completion_tokens") is not None:
        return "max_completion_tokens", body["max_completion_tokens"]
    return "max_tokens", body.get("max_tokens")


def _int_param(name: str, value: object, *, at_most: int | None = None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be a number", name)
    if at_most is not None and value > at_most:
        raise ApiError(400, f"{name} must be at most {at_most}, got {value}", name)
    return value


def _float_param(name: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"{name} must be a number", name)
    try:
        return float(value)
    except OverflowError as error:  # an integer past what a float holds
        raise ApiError(400, f"{name} is out of range: {error}", name) from error


def _stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise ApiError(400, "stop must be a string or a list of strings", "stop")
