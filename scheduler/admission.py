"""What a submitted request must be to join the queue: every field checked, whoever sent it, before any state is
made; a request that fails a check is refused (RequestRejected) with the reason its client is told."""

from __future__ import annotations

import math
from collections.abc import Container

from proto import messages as m
from scheduler.requests import Request

# The protocol's limits (proto/messages.py), which size the gateway socket's frames (proto/frames.py).
MAX_REQUEST_ID_CHARS = m.MAX_REQUEST_ID_CHARS
MAX_STOP_TOKEN_IDS = m.MAX_STOP_TOKEN_IDS
MAX_GRAMMAR_CHARS = m.MAX_GRAMMAR_CHARS
MAX_CACHE_SALT_CHARS = m.MAX_CACHE_SALT_CHARS


class RequestRejected(Exception):
    def __init__(self, code: m.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def submit_problem(
    submit: m.SubmitRequest, ids_in_use: Container[str], max_model_len: int, vocab_size: int, *, by_priority: bool
) -> str:
    """Why a submitted request cannot be served ("" when it can).

    Everything is checked: its id (not one in `ids_in_use`), token ids against the targets'
    vocabulary (`vocab_size`, 0 while no target has said hello: then when the first one
    does), sampling values, sizes, and a priority only where the queue is kept by priority
    (`by_priority`).
    """
    num_prompt = len(submit.prompt_token_ids)
    if not 0 < len(submit.request_id) <= MAX_REQUEST_ID_CHARS:
        return f"request_id must have 1 to {MAX_REQUEST_ID_CHARS} characters"
    if submit.request_id in ids_in_use:
        return f"request_id {submit.request_id!r} is already in use"
    if problem := sampling_problem(submit.sampling) or token_problem(submit, vocab_size):
        return problem
    if submit.grammar is not None and not 0 < len(submit.grammar) <= MAX_GRAMMAR_CHARS:
        return f"grammar must have 1 to {MAX_GRAMMAR_CHARS} characters"
    if len(submit.cache_salt) > MAX_CACHE_SALT_CHARS:
        return f"cache_salt has more than {MAX_CACHE_SALT_CHARS} characters"
    if len(submit.tenant) > m.MAX_TENANT_CHARS:
        return f"tenant has more than {m.MAX_TENANT_CHARS} characters"
    if len(submit.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        return f"stop_token_ids has more than {MAX_STOP_TOKEN_IDS} ids"
    if num_prompt == 0:
        return "prompt_token_ids is empty"
    if not 0 <= submit.resumed_tokens < num_prompt:
        return f"resumed_tokens {submit.resumed_tokens} is not less than the {num_prompt} tokens of prompt_token_ids"
    for name, count in (("logprobs", submit.logprobs), ("prompt_logprobs", submit.prompt_logprobs)):
        if count is not None and not 0 <= count <= m.MAX_TOP_LOGPROBS:
            return f"{name} must be 0 to {m.MAX_TOP_LOGPROBS}, got {count}"
    least = 0 if submit.prompt_logprobs is not None else 1  # scoring a prompt alone generates nothing
    if submit.max_tokens is not None and submit.max_tokens < least:
        return f"max_tokens must be at least {least}, got {submit.max_tokens}"
    max_tokens = granted_max_tokens(submit, max_model_len)
    if num_prompt + max(max_tokens, 1) > max_model_len:
        return (
            f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) exceeds the context of {max_model_len} tokens"
        )
    if submit.priority and not by_priority:
        return (
            f"priority {submit.priority}: this scheduler serves requests in the order they come "
            "(--scheduling-policy fcfs); only 0 is taken"
        )
    if not m.MIN_PRIORITY <= submit.priority <= m.MAX_PRIORITY:
        return f"priority must be in [{m.MIN_PRIORITY}, {m.MAX_PRIORITY}], got {submit.priority}"
    return ""


def granted_max_tokens(submit: m.SubmitRequest, max_model_len: int) -> int:
    """The completion tokens a request may generate: as many as it asked for, else what the context leaves."""
    return submit.max_tokens if submit.max_tokens is not None else max_model_len - len(submit.prompt_token_ids)


def sampling_problem(sampling: m.SamplingParams) -> str:
    """Why these sampling values cannot be served ("" when they can)."""
    if not math.isfinite(sampling.temperature) or not 0.0 <= sampling.temperature <= m.MAX_TEMPERATURE:
        return f"temperature {sampling.temperature} is outside 0 .. {m.MAX_TEMPERATURE:g}"
    if not (math.isfinite(sampling.top_p) and 0.0 < sampling.top_p <= 1.0):
        return f"top_p {sampling.top_p} is outside (0, 1]"
    if sampling.top_k < 0:
        return f"top_k {sampling.top_k} is negative"
    if not 0.0 <= sampling.min_p <= 1.0:  # also false for NaN
        return f"min_p {sampling.min_p} is outside [0, 1]"
    if not 0 <= sampling.seed < 1 << 64:
        return f"seed {sampling.seed} is outside 0 .. 2^64 - 1"
    return penalties_problem(sampling.penalties) if sampling.penalties is not None else ""


def penalties_problem(penalties: m.Penalties) -> str:
    """Why these penalties cannot be served ("" when they can); token ids are checked with the prompt's."""
    for name, value in (("presence_penalty", penalties.presence), ("frequency_penalty", penalties.frequency)):
        if not (math.isfinite(value) and -m.MAX_PENALTY <= value <= m.MAX_PENALTY):
            return f"{name} {value} is outside -{m.MAX_PENALTY} .. {m.MAX_PENALTY}"
    if not (
        math.isfinite(penalties.repetition)
        and m.MIN_REPETITION_PENALTY <= penalties.repetition <= m.MAX_REPETITION_PENALTY
    ):
        return (
            f"repetition_penalty {penalties.repetition} is outside "
            f"{m.MIN_REPETITION_PENALTY} .. {m.MAX_REPETITION_PENALTY}"
        )
    if len(penalties.logit_bias) > m.MAX_LOGIT_BIAS_ENTRIES:
        return f"logit_bias has {len(penalties.logit_bias)} entries, at most {m.MAX_LOGIT_BIAS_ENTRIES}"
    for token, bias in penalties.logit_bias.items():
        if not (math.isfinite(bias) and -m.MAX_LOGIT_BIAS <= bias <= m.MAX_LOGIT_BIAS):
            return f"logit_bias of token {token} is {bias}, outside -{m.MAX_LOGIT_BIAS} .. {m.MAX_LOGIT_BIAS}"
    if penalties.min_tokens < 0:
        return f"min_tokens {penalties.min_tokens} is negative"
    if len(penalties.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        return f"the penalties' stop_token_ids has more than {MAX_STOP_TOKEN_IDS} ids"
    return ""


def token_problem(submit: m.SubmitRequest | Request, vocab_size: int) -> str:
    """A prompt or stop token id outside the vocabulary of `vocab_size` ids (any negative one when it is not known)."""
    penalties = submit.sampling.penalties or m.Penalties()
    for field_name, ids in (
        ("prompt_token_ids", list(submit.prompt_token_ids)),
        ("stop_token_ids", list(submit.stop_token_ids)),
        ("logit_bias", list(penalties.logit_bias)),
        ("min_tokens' stop_token_ids", penalties.stop_token_ids),
    ):
        if ids and (min(ids) < 0 or (vocab_size and max(ids) >= vocab_size)):
            bad = next(i for i in ids if i < 0 or (vocab_size and i >= vocab_size))
            return f"{field_name} holds {bad}, outside the vocabulary of {vocab_size or 'the model'} ids"
    return ""
