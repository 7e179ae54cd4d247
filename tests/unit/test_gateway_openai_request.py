"""OpenAI bodies to checked Submissions: wrong types are ApiErrors, bad values InvalidArguments, each naming the body's field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.app import load_tokenizer
from gateway.errors import InvalidArgument, StartupError
from gateway.generation import prompt_token_ids_of
from gateway.openai_request import ApiError, chat_prompt, client_request_of, completion_prompt
from gateway.request import Submission, TextPrompt, TokenPrompt
from gateway.validation import validate
from modeling.tokenizer import Tokenizer
from proto import messages

VOCAB_SIZE = 49152
CHAT = [{"role": "user", "content": "hi"}]


def submission(body: dict[str, Any]) -> Submission:
    """As the HTTP API does it: the prompt, then the parameters, then `validate` with the body's names."""
    chat = "messages" in body
    prompt = chat_prompt(body) if chat else completion_prompt(body)
    request, fields = client_request_of(body, prompt, chat=chat)
    return validate(request, fields=fields, request_id="cmpl-1", vocab_size=VOCAB_SIZE)


BAD_VALUES = [
    ("temperature", {"prompt": "x", "temperature": -1}, "temperature: must be finite and >= 0, got -1.0"),
    ("top_p", {"prompt": "x", "top_p": 0}, "top_p: must be in (0, 1], got 0.0"),
    ("max_tokens", {"prompt": "x", "max_tokens": 0}, "max_tokens: must be at least 1, got 0"),
    ("top_k", {"prompt": "x", "top_k": -2}, "top_k: must be >= 0 (0 = no top-k cut), got -2"),
    ("prompt", {"prompt": ""}, "prompt: must not be empty"),
    ("prompt", {"prompt": [1, VOCAB_SIZE]}, f"prompt: token id {VOCAB_SIZE} is outside the vocabulary [0, {VOCAB_SIZE})"),
    ("prompt", {"prompt": [1, 2**40]}, f"prompt: token id {2**40} is outside the vocabulary [0, {VOCAB_SIZE})"),
    ("stop[1]", {"prompt": "x", "stop": ["ok", ""]}, "stop[1]: must not be empty"),
    ("messages[1].role", {"messages": [*CHAT, {"role": "", "content": "a"}]}, "messages[1].role: must not be empty"),
    ("max_completion_tokens", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens: must be at least 1, got 0"),
    ("max_tokens", {"messages": CHAT, "max_tokens": 0}, "max_tokens: must be at least 1, got 0"),
]


@pytest.mark.parametrize(("field", "body", "message"), BAD_VALUES, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(BAD_VALUES)])
def test_bad_values_name_the_bodys_field(field: str, body: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        submission(body)
    assert (caught.value.field, caught.value.message) == (field, message)
    error = ApiError.from_failure(caught.value)
    assert (error.status, error.param, error.message) == (400, field, message)


BAD_TYPES = [
    ("prompt", {"prompt": 5}),
    ("prompt", {"prompt": []}),
    ("messages", {"messages": "hello"}),
    ("messages[0]", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("max_tokens", {"prompt": "x", "max_tokens": "many"}),
    ("max_tokens", {"prompt": "x", "max_tokens": 2**31}),
    ("top_k", {"prompt": "x", "top_k": 2**40}),
    ("temperature", {"prompt": "x", "temperature": 10**400}),
    ("temperature", {"prompt": "x", "temperature": True}),
    ("seed", {"prompt": "x", "seed": 1.5}),
    ("stop", {"prompt": "x", "stop": [1]}),
    ("n", {"prompt": "x", "n": 2}),
    ("logprobs", {"prompt": "x", "logprobs": 0}),
    ("echo", {"prompt": "x", "echo": True}),
    ("logit_bias", {"prompt": "x", "logit_bias": {"42": 5}}),
]


@pytest.mark.parametrize(("param", "body"), BAD_TYPES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_TYPES)])
def test_wrong_types_are_refused_before_validation(param: str, body: dict[str, Any]) -> None:
    with pytest.raises(ApiError) as caught:
        submission(body)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert caught.value.body()["error"]["type"] == "invalid_request_error"


def test_out_of_range_numbers_say_so() -> None:
    with pytest.raises(ApiError, match="temperature is out of range: int too large to convert to float"):
        submission({"prompt": "x", "temperature": 10**400})
    with pytest.raises(ApiError, match="max_tokens must be at most 2147483647, got 2147483648"):
        submission({"prompt": "x", "max_tokens": 2**31})


def test_openai_defaults_and_vllm_extensions() -> None:
    checked = submission({"prompt": ["Hi"], "top_k": -1, "seed": -5, "ignore_eos": True, "stop": "\n"})
    assert checked.prompt == TextPrompt("Hi") and checked.prompt_field == "prompt"
    assert checked.max_tokens == 16  # OpenAI's default for completions
    assert checked.sampling == messages.SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=-5 % 2**63)
    assert checked.seed_given and checked.ignore_eos and checked.stop_strings == ("\n",)
    assert submission({"prompt": [3, 4], "temperature": 0}).prompt == TokenPrompt((3, 4))
    chat = submission({"messages": CHAT, "max_completion_tokens": None, "max_tokens": 3, "seed": None})
    assert chat.max_tokens == 3 and not chat.seed_given and chat.prompt_field == "messages"
    assert submission({"messages": CHAT}).max_tokens is None


def test_a_chat_template_error_names_messages(tmp_path: Path, default_model_dir: Path) -> None:
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes((default_model_dir / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ raise_exception(\'roles must alternate\') }}"}')
    with pytest.raises(InvalidArgument, match="messages: .*roles must alternate") as caught:
        prompt_token_ids_of(Tokenizer.load(tmp_path), submission({"messages": CHAT}))
    assert ApiError.from_failure(caught.value).param == "messages"


def test_an_unreadable_tokenizer_is_a_startup_error(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match=f"cannot load {tmp_path / 'tokenizer.json'}"):
        load_tokenizer(tmp_path)
