"""A body of SGLang's native POST /generate, checked and turned into one ClientRequest per prompt.

Here only what JSON can get wrong is checked (a string where a number belongs, a field this
server does not implement, named whatever its value); the values are checked by
`validation.validate` with SGLANG_FIELDS, so every error names the body's own field, as
openai_request.py does for OpenAI's bodies.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.api_error import ApiError
from gateway.request import ClientRequest, Prompt, TextPrompt, TokenPrompt
from gateway.structured_request import Asked, SpecError, parsed_schema
from gateway.validation import FieldNames, checked_request_id
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


@dataclass(frozen=True)
class GenerateBody:
    """A /generate body, checked: each prompt's request under the id its replies carry, and what the answer holds."""

    requests: tuple[tuple[str, ClientRequest], ...]  # each prompt's reply id and request, in the body's order
    single: bool  # one prompt, not a list of them: the answer is one object, not a list
    return_logprob: bool
    with_text: bool  # return_text_in_logprobs: each log-probability comes with its token's text
    logprob_start: int  # logprob_start_len: the prompt's log-probabilities from this position on
    stream: bool


def generate_body(body: dict[str, Any]) -> GenerateBody:
    """The body's prompts and parameters; raises ApiError for a field of the wrong type or one this server does not
    implement (the first wrong one, in the order they are read)."""
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
    ids = request_ids(body.get("rid"), len(prompts), single)
    requests = []
    for request_id, prompt in zip(ids, prompts):
        client_request = _client_request(
            params, prompt, logprobs=top if return_logprob else None, scores_prompt=return_logprob and start >= 0
        )
        requests.append((request_id, dataclasses.replace(client_request, cache_salt=cache_salt, priority=priority)))
    return GenerateBody(tuple(requests), single, return_logprob, with_text, max(start, 0), stream)


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


def request_ids(rid: object, num_prompts: int, single: bool) -> list[str]:
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
