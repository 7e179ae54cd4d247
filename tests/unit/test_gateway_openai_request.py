"""OpenAI bodies to checked Submissions: wrong types are ApiErrors, bad values InvalidArguments,
each naming the body's field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.api_error import ApiError
from gateway.app import load_tokenizer
from gateway.errors import InvalidArgument, StartupError
from gateway.generation import prompt_token_ids_of
from gateway.openai_chat_prompt import chat_prompt
from gateway.openai_request import (
    MAX_CHOICES,
    MAX_PROMPTS,
    ChoiceCounts,
    choice_counts,
    client_request_of,
    completion_prompts,
)
from gateway.request import Submission, TextPrompt, TokenPrompt
from gateway.validation import validate
from common.text.tokenizer import Tokenizer, TokenizerLoadError
from proto import messages

VOCAB_SIZE = 49152
CHAT = [{"role": "user", "content": "hi"}]


def submission(body: dict[str, Any]) -> Submission:
    """As the HTTP API does it: the prompt, then the parameters, then `validate` with the body's names."""
    chat = "messages" in body
    (prompt,) = [chat_prompt(body)] if chat else completion_prompts(body)
    request, fields = client_request_of(body, prompt, chat=chat)
    return validate(request, fields=fields, request_id="cmpl-1", vocab_size=VOCAB_SIZE)


BAD_VALUES = [
    ("temperature", {"prompt": "x", "temperature": -1}, "temperature: must be finite and >= 0, got -1.0"),
    ("top_p", {"prompt": "x", "top_p": 0}, "top_p: must be in (0, 1], got 0.0"),
    ("max_tokens", {"prompt": "x", "max_tokens": 0}, "max_tokens: must be at least 1, got 0"),
    ("top_k", {"prompt": "x", "top_k": -2}, "top_k: must be >= 0 (0 = no top-k cut), got -2"),
    ("min_p", {"prompt": "x", "min_p": 1.5}, "min_p: must be in [0, 1], got 1.5"),
    ("min_p", {"prompt": "x", "min_p": -0.1}, "min_p: must be in [0, 1], got -0.1"),
    ("prompt", {"prompt": ""}, "prompt: must not be empty"),
    (
        "prompt",
        {"prompt": [1, VOCAB_SIZE]},
        f"prompt: token id {VOCAB_SIZE} is outside the vocabulary [0, {VOCAB_SIZE})",
    ),
    ("prompt", {"prompt": [1, 2**40]}, f"prompt: token id {2**40} is outside the vocabulary [0, {VOCAB_SIZE})"),
    ("stop[1]", {"prompt": "x", "stop": ["ok", ""]}, "stop[1]: must not be empty"),
    ("messages[1].role", {"messages": [*CHAT, {"role": "", "content": "a"}]}, "messages[1].role: must not be empty"),
    (
        "max_completion_tokens",
        {"messages": CHAT, "max_completion_tokens": 0},
        "max_completion_tokens: must be at least 1, got 0",
    ),
    ("max_tokens", {"messages": CHAT, "max_tokens": 0}, "max_tokens: must be at least 1, got 0"),
    ("max_tokens", {"prompt": "x", "logprobs": 1, "max_tokens": 0}, "max_tokens: must be at least 1, got 0"),
    ("max_tokens", {"prompt": "x", "echo": True, "max_tokens": -1}, "max_tokens: must be at least 0, got -1"),
    ("logprobs", {"prompt": "x", "logprobs": 21}, "logprobs: must be 0 to 20, got 21"),
    ("logprobs", {"prompt": "x", "logprobs": -1, "echo": True}, "logprobs: must be 0 to 20, got -1"),
    ("top_logprobs", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs: must be 0 to 20, got 21"),
    ("presence_penalty", {"prompt": "x", "presence_penalty": 3}, "presence_penalty: must be in [-2, 2], got 3.0"),
    (
        "frequency_penalty",
        {"prompt": "x", "frequency_penalty": -2.5},
        "frequency_penalty: must be in [-2, 2], got -2.5",
    ),
    (
        "repetition_penalty",
        {"prompt": "x", "repetition_penalty": 0},
        "repetition_penalty: must be in [0.01, 100], got 0.0",
    ),
    (
        f"logit_bias[{VOCAB_SIZE}]",
        {"prompt": "x", "logit_bias": {str(VOCAB_SIZE): 1}},
        f"logit_bias[{VOCAB_SIZE}]: token id {VOCAB_SIZE} is outside the vocabulary [0, {VOCAB_SIZE})",
    ),
    ("logit_bias[5]", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias[5]: must be in [-100, 100], got 101.0"),
    (
        "min_tokens",
        {"prompt": "x", "max_tokens": 3, "min_tokens": 5},
        "min_tokens: must be at most max_tokens (3), got 5",
    ),
    ("min_tokens", {"prompt": "x", "min_tokens": -1}, "min_tokens: must be >= 0, got -1"),
]


@pytest.mark.parametrize(
    ("field", "body", "message"), BAD_VALUES, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(BAD_VALUES)]
)
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
    ("logprobs", {"prompt": "x", "logprobs": "yes"}),
    ("logprobs", {"messages": CHAT, "logprobs": 1}),
    ("top_logprobs", {"messages": CHAT, "top_logprobs": 2}),
    ("echo", {"prompt": "x", "echo": 1}),
    ("prompt", {"prompt": ["x", 5]}),
    ("prompt", {"prompt": ["x"] * (MAX_PROMPTS + 1)}),
    ("logit_bias", {"prompt": "x", "logit_bias": [5]}),
    ("logit_bias", {"prompt": "x", "logit_bias": {"the": 5}}),
    ("logit_bias[5]", {"prompt": "x", "logit_bias": {"5": "high"}}),
    ("logit_bias[5]", {"prompt": "x", "logit_bias": {"5": None}}),
    ("min_tokens", {"prompt": "x", "min_tokens": 1.5}),
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


NOT_DONE_HERE = [
    ("tools", {"prompt": "x", "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("tool_choice", {"prompt": "x", "tool_choice": "required"}),  # completions take no tools
    ("functions", {"messages": CHAT, "functions": [{"name": "f"}]}),
    ("function_call", {"messages": CHAT, "function_call": "auto"}),
    ("suffix", {"prompt": "x", "suffix": "end"}),
    ("reasoning_effort", {"messages": CHAT, "reasoning_effort": "low"}),
    ("store", {"messages": CHAT, "store": True}),
    ("modalities", {"messages": CHAT, "modalities": ["text", "audio"]}),
    ("service_tier", {"prompt": "x", "service_tier": "flex"}),
    ("prediction", {"messages": CHAT, "prediction": {"type": "content", "content": "x"}}),
    ("messages[0].refusal", {"messages": [{"role": "assistant", "content": "x", "refusal": "no"}]}),
    ("top_logprobs", {"prompt": "x", "top_logprobs": 2}),  # chat's field, not a completion's
    ("echo", {"messages": CHAT, "echo": True}),  # a completion's, not chat's
    ("messages[0].function_call", {"messages": [{"role": "assistant", "content": "", "function_call": {}}]}),
    ("messages[0].name", {"messages": [{"role": "user", "content": "hi", "name": "ann"}]}),
]


@pytest.mark.parametrize(("param", "body"), NOT_DONE_HERE, ids=[p for p, _ in NOT_DONE_HERE])
def test_a_field_this_server_does_not_honour_is_refused_by_name(param: str, body: dict[str, Any]) -> None:
    with pytest.raises(ApiError) as caught:
        submission(body)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert f"{param} is not supported by this server" in caught.value.message


def test_fields_that_ask_for_nothing_are_taken() -> None:
    plain = submission({"messages": CHAT})
    for extra in (
        {"tools": [], "tool_choice": "none", "parallel_tool_calls": True},
        {"min_p": 0, "priority": 0},
        {"tools": None, "functions": []},
        {"user": "client-7"},
        {"suffix": ""},
    ):
        checked = submission({"messages": CHAT, **extra})
        assert (checked.sampling, checked.max_tokens, checked.stop_token_ids) == (plain.sampling, plain.max_tokens, ())
    with pytest.raises(ApiError) as caught:
        submission({"messages": CHAT, "user": 7})
    assert caught.value.param == "user"


def test_priority_reaches_the_scheduler_and_must_be_an_int32() -> None:
    assert submission({"prompt": "x", "priority": -4}).priority == -4
    assert submission({"prompt": "x"}).priority == 0
    assert submission({"prompt": "x"}).to_submit_request([1], eos_token_ids=[2]).priority == 0
    with pytest.raises(ApiError):
        submission({"prompt": "x", "priority": "high"})
    with pytest.raises(InvalidArgument, match="priority: must be in"):
        submission({"prompt": "x", "priority": 2**31})


def test_min_p_reaches_the_sampling_parameters() -> None:
    assert submission({"prompt": "x", "min_p": 0.05}).sampling.min_p == 0.05
    assert submission({"prompt": "x"}).sampling.min_p == 0.0


def test_stop_token_ids_are_taken_and_checked_by_name() -> None:
    assert submission({"prompt": "x", "stop_token_ids": [5, 7]}).stop_token_ids == (5, 7)
    with pytest.raises(ApiError) as caught:
        submission({"prompt": "x", "stop_token_ids": "5"})
    assert caught.value.param == "stop_token_ids"
    with pytest.raises(InvalidArgument) as invalid:
        submission({"prompt": "x", "stop_token_ids": [5, VOCAB_SIZE]})
    assert invalid.value.field == "stop_token_ids[1]"


def test_logprobs_and_echo_ask_for_completion_and_prompt_log_probabilities() -> None:
    plain = submission({"prompt": "x", "logprobs": 0})
    assert (plain.logprobs, plain.prompt_logprobs, plain.max_tokens) == (0, None, 16)
    scored = submission({"prompt": "x", "logprobs": 2, "echo": True, "max_tokens": 0})
    assert (scored.logprobs, scored.prompt_logprobs, scored.max_tokens) == (2, 2, 0)
    echoed = submission({"prompt": "x", "echo": True, "max_tokens": 0})  # an echo alone: the prompt, nothing scored
    assert (echoed.logprobs, echoed.prompt_logprobs) == (None, 0)
    assert submission({"prompt": "x", "logprobs": False, "echo": False}).logprobs is None
    chat = submission({"messages": CHAT, "logprobs": True, "top_logprobs": 3})
    assert (chat.logprobs, chat.prompt_logprobs) == (3, None)
    assert submission({"messages": CHAT, "logprobs": True}).logprobs == 0
    assert submission({"messages": CHAT, "logprobs": False}).logprobs is None
    submit = scored.to_submit_request([5, 6], (2,))
    assert (submit.logprobs, submit.prompt_logprobs, submit.max_tokens) == (2, 2, 0)


def test_penalties_are_passed_on_and_none_asked_is_none() -> None:
    asked = submission(
        {
            "prompt": "x",
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "repetition_penalty": 1.2,
            "logit_bias": {"5": -100, "7": 3.5},
            "min_tokens": 2,
            "ignore_eos": False,
        }
    )
    assert asked.sampling.penalties == messages.Penalties(
        presence=0.5, frequency=-1.0, repetition=1.2, logit_bias={5: -100.0, 7: 3.5}, min_tokens=2
    )
    submit = asked.to_submit_request([1, 2], (2,))
    assert submit.sampling.penalties is not None and submit.sampling.penalties.stop_token_ids == [2]  # held back
    for harmless in (
        {},
        {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1, "logit_bias": {}, "min_tokens": 0},
    ):
        assert submission({"prompt": "x", **harmless}).sampling.penalties is None


def test_n_and_best_of_count_the_choices_and_refuse_what_cannot_be_served() -> None:
    assert choice_counts({}, chat=False, stream=False, num_prompts=1) == ChoiceCounts(1, 1)
    assert choice_counts({"n": 3, "best_of": 5}, chat=False, stream=False, num_prompts=2) == ChoiceCounts(3, 5)
    assert choice_counts({"n": 4}, chat=True, stream=True, num_prompts=1) == ChoiceCounts(4, 4)
    for body, chat, stream, num_prompts, param in (
        ({"n": 0}, False, False, 1, "n"),
        ({"n": "2"}, False, False, 1, "n"),
        ({"n": 2, "best_of": 1}, False, False, 1, "best_of"),
        ({"best_of": 2}, True, False, 1, "best_of"),
        ({"n": 1, "best_of": 2}, False, True, 1, "best_of"),
        ({"n": MAX_CHOICES}, False, False, 2, "n"),
        ({"best_of": MAX_CHOICES + 1}, False, False, 1, "best_of"),
    ):
        with pytest.raises(ApiError) as caught:
            choice_counts(body, chat=chat, stream=stream, num_prompts=num_prompts)
        assert (caught.value.status, caught.value.param) == (400, param), body


def test_a_list_of_prompts_is_one_choice_each_in_order() -> None:
    assert completion_prompts({"prompt": ["a", [3, 4], "b"]}) == [TextPrompt("a"), TokenPrompt((3, 4)), TextPrompt("b")]
    assert completion_prompts({"prompt": [[7]]}) == [TokenPrompt((7,))]
    assert completion_prompts({"prompt": [7, 8]}) == [TokenPrompt((7, 8))]


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking %}<think>\n{% endif %}"
)


def test_chat_template_kwargs_reach_the_template_and_a_template_file_replaces_the_models(
    tmp_path: Path, default_model_dir: Path
) -> None:
    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    tokenizer = Tokenizer.load(default_model_dir, template)
    plain = submission({"messages": CHAT})
    thinking = submission({"messages": CHAT, "chat_template_kwargs": {"enable_thinking": True}})
    assert plain.prompt != thinking.prompt
    plain_text = tokenizer.decode(prompt_token_ids_of(tokenizer, plain.prompt, plain.prompt_field))
    thinking_ids = prompt_token_ids_of(tokenizer, thinking.prompt, thinking.prompt_field)
    assert tokenizer.decode(thinking_ids) == plain_text + "<think>\n"
    # The model's own template reads no such variable: the same tokens with or without it.
    own = Tokenizer.load(default_model_dir)
    assert prompt_token_ids_of(own, thinking.prompt, "messages") == prompt_token_ids_of(own, plain.prompt, "messages")
    with pytest.raises(TokenizerLoadError, match="cannot read the chat template"):
        Tokenizer.load(default_model_dir, tmp_path / "missing.jinja")
    for kwargs, param in (
        ({"messages": []}, "chat_template_kwargs.messages"),
        ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
        (["enable_thinking"], "chat_template_kwargs"),
    ):
        with pytest.raises(ApiError) as caught:
            submission({"messages": CHAT, "chat_template_kwargs": kwargs})
        assert caught.value.param == param


def test_a_chat_template_error_names_messages(tmp_path: Path, default_model_dir: Path) -> None:
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes((default_model_dir / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": "{{ raise_exception(\'roles must alternate\') }}"}'
    )
    with pytest.raises(InvalidArgument, match="messages: .*roles must alternate") as caught:
        checked = submission({"messages": CHAT})
        prompt_token_ids_of(Tokenizer.load(tmp_path), checked.prompt, checked.prompt_field)
    assert ApiError.from_failure(caught.value).param == "messages"


def test_an_unreadable_tokenizer_is_a_startup_error(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match=f"cannot load {tmp_path / 'tokenizer.json'}"):
        load_tokenizer(tmp_path)
