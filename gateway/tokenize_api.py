"""Counting tokens without generating: `POST /tokenize` and `POST /detokenize` in vLLM's shapes, and gRPC's Tokenize
and Detokenize, which clients use to fit prompts to the context.

`/tokenize` takes a `prompt` (text, with the tokenizer's special tokens unless
`add_special_tokens` is false) or chat `messages` (rendered by the model's chat template with
the assistant's generation prompt, no special tokens added unless `add_special_tokens`), and
answers the ids a generation request with that prompt would be given, their `count`, the
context (`max_model_len`) and, with `return_token_strs`, each token as text. `/detokenize`
takes `tokens` and answers the text (`prompt`), special tokens left out as in completions.
Fields neither reads are refused naming them, as everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.api_error import ApiError
from gateway.errors import InvalidArgument
from gateway.generation import Generation
from gateway.openai_chat_prompt import chat_prompt
from gateway.openai_request import check_fields, token_ids_param
from gateway.request import Prompt, TextPrompt
from gateway.validation import token_ids_in_vocab

TOKENIZE_TEXT_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
TOKENIZE_CHAT_FIELDS = frozenset(
    {"model", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs", "chat_template_kwargs"}
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


async def tokenize_body(generation: Generation, body: dict[str, Any]) -> dict[str, Any]:
    """/tokenize's answer for an HTTP body; raises ApiError (or InvalidArgument) naming the field."""
    chat = "messages" in body
    check_fields(body, TOKENIZE_CHAT_FIELDS if chat else TOKENIZE_TEXT_FIELDS)
    special = _flag(body, "add_special_tokens")
    if chat:
        if _flag(body, "add_generation_prompt") is False:
            raise ApiError(
                400,
                "add_generation_prompt: only true is served (the prompt a chat request is given)",
                "add_generation_prompt",
            )
        prompt: Prompt = chat_prompt(body)
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise ApiError(400, "prompt must be a string (or send messages)", "prompt")
        prompt = TextPrompt(text)
    token_ids = await generation.tokenize(prompt, "messages" if chat else "prompt", special_tokens=special)
    return {
        "count": len(token_ids),
        "max_model_len": await generation.scheduler.max_model_len(),
        "tokens": token_ids,
        "token_strs": token_strs(generation, token_ids) if _flag(body, "return_token_strs") else None,
    }


async def detokenize_body(generation: Generation, body: dict[str, Any]) -> dict[str, Any]:
    """/detokenize's answer for an HTTP body; raises ApiError (or InvalidArgument) naming the field."""
    check_fields(body, DETOKENIZE_FIELDS)
    if body.get("tokens") is None:
        raise ApiError(400, "tokens must be a list of token ids", "tokens")
    tokens = token_ids_param("tokens", body["tokens"])
    return {"prompt": await detokenize(generation, tokens, "tokens")}


async def detokenize(generation: Generation, token_ids: Sequence[int], field: str) -> str:
    """The ids' text, special tokens left out; raises InvalidArgument for more ids than a context holds or naming the
    first id outside the vocabulary."""
    if len(token_ids) > (context := await generation.scheduler.max_model_len()):
        raise InvalidArgument(field, f"holds {len(token_ids)} token ids, more than a context of {context}")
    token_ids_in_vocab(f"{field}[{{index}}]", token_ids, generation.tokenizer.vocab_size)
    return generation.tokenizer.decode(token_ids)


def token_strs(generation: Generation, token_ids: Sequence[int]) -> list[str]:
    """Each token as text, special tokens too (as log-probabilities name them)."""
    return [generation.tokenizer.token_text(token_id) for token_id in token_ids]


def _flag(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a boolean", name)
    return value
