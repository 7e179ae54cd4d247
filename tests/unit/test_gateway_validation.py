"""GenerateRequest validation: every bad field is named in an INVALID_ARGUMENT; good requests become Submissions.

The rules are the gateway's one `validate`; these tests reach it through the gRPC API's
request and field names (the HTTP API's are in test_gateway_openai_request.py).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import grpc
import pytest

from gateway.errors import InvalidArgument
from gateway.generation import prompt_token_ids_of
from gateway.grpc_request import GRPC_FIELDS, client_request_of, request_id_of, submission_of
from gateway.request import ChatPrompt, Submission, TextPrompt, TokenPrompt
from gateway.validation import validate
from common.text.tokenizer import ChatMessage, ChatTemplateError, Tokenizer
from proto import messages
from proto import specserve_pb2 as pb

VOCAB_SIZE = 49152


def check(request: pb.GenerateRequest) -> Submission:
    return submission_of(request, request_id="r1", vocab_size=VOCAB_SIZE)


def params(**fields: object) -> pb.SamplingParams:
    return pb.SamplingParams(**fields)  # type: ignore[arg-type]


BAD_REQUESTS = [
    ("input", pb.GenerateRequest()),
    ("prompt", pb.GenerateRequest(prompt="")),
    ("chat.messages", pb.GenerateRequest(chat=pb.ChatMessages())),
    (
        "chat.messages[1].role",
        pb.GenerateRequest(
            chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="a"), pb.ChatMessage(content="b")])
        ),
    ),
    ("token_ids.ids", pb.GenerateRequest(token_ids=pb.TokenIds())),
    ("token_ids.ids[1]", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, VOCAB_SIZE]))),
    ("token_ids.ids[0]", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[-1]))),
    ("params.temperature", pb.GenerateRequest(prompt="x", params=params(temperature=-0.5))),
    ("params.temperature", pb.GenerateRequest(prompt="x", params=params(temperature=math.nan))),
    ("params.temperature", pb.GenerateRequest(prompt="x", params=params(temperature=math.inf))),
    ("params.top_p", pb.GenerateRequest(prompt="x", params=params(top_p=0.0))),
    ("params.top_p", pb.GenerateRequest(prompt="x", params=params(top_p=1.5))),
    ("params.top_p", pb.GenerateRequest(prompt="x", params=params(top_p=-0.1))),
    ("params.top_p", pb.GenerateRequest(prompt="x", params=params(top_p=math.nan))),
    ("params.top_k", pb.GenerateRequest(prompt="x", params=params(top_k=-1))),
    ("params.min_p", pb.GenerateRequest(prompt="x", params=params(min_p=1.01))),
    ("params.min_p", pb.GenerateRequest(prompt="x", params=params(min_p=math.nan))),
    ("params.max_tokens", pb.GenerateRequest(prompt="x", params=params(max_tokens=0))),
    ("params.max_tokens", pb.GenerateRequest(prompt="x", params=params(max_tokens=-3))),
    ("params.seed", pb.GenerateRequest(prompt="x", params=params(seed=-1))),
    ("params.stop[1]", pb.GenerateRequest(prompt="x", params=params(stop=["ok", ""]))),
    ("params.stop_token_ids[0]", pb.GenerateRequest(prompt="x", params=params(stop_token_ids=[VOCAB_SIZE + 7]))),
    ("params.stop_token_ids[256]", pb.GenerateRequest(prompt="x", params=params(stop_token_ids=[5] * 257))),
    ("params.temperature", pb.GenerateRequest(prompt="x", params=params(temperature=1e4 + 1))),
    ("params.repetition_penalty", pb.GenerateRequest(prompt="x", params=params(repetition_penalty=0.009))),
    ("params.repetition_penalty", pb.GenerateRequest(prompt="x", params=params(repetition_penalty=1e-300))),
    ("params.repetition_penalty", pb.GenerateRequest(prompt="x", params=params(repetition_penalty=math.inf))),
]


# What only a front end's slip could pass (protobuf's types cannot):
# a bool or a float where an integer belongs, a number
# past a float's range or an int64's, a string for a number. `validate` refuses each, naming the field, so the request
# never becomes a message the scheduler cannot read.
SLIPS = [
    ("max_tokens", 2.5),
    ("max_tokens", True),
    ("max_tokens", 2**31),
    ("top_k", math.inf),
    ("top_k", 2**31),
    ("seed", 1.5),
    ("seed", 2**64),
    ("min_tokens", 2.5),
    ("min_tokens", 2**31),
    ("logprobs", True),
    ("temperature", "1"),
    ("top_p", 10**400),
    ("min_p", "0.1"),
    ("repetition_penalty", False),
    ("presence_penalty", 10**400),
    ("stop_token_ids", (True,)),
    ("logit_bias", ((True, 1.0),)),
    ("logit_bias", ((5, "1"),)),
]


@pytest.mark.parametrize(("name", "value"), SLIPS, ids=[f"{name}-{value!r:.12}" for name, value in SLIPS])
def test_a_value_of_the_wrong_type_or_past_every_bound_is_refused_by_validate_itself(name: str, value: object) -> None:
    request = dataclasses.replace(client_request_of(pb.GenerateRequest(prompt="x")), **{name: value})
    with pytest.raises(InvalidArgument) as caught:
        validate(request, fields=GRPC_FIELDS, request_id="r1", vocab_size=VOCAB_SIZE)
    assert caught.value.field.startswith(f"params.{name}"), caught.value


@pytest.mark.parametrize(
    ("field", "request_message"), BAD_REQUESTS, ids=[f"{field}-{i}" for i, (field, _) in enumerate(BAD_REQUESTS)]
)
def test_every_bad_field_is_named(field: str, request_message: pb.GenerateRequest) -> None:
    with pytest.raises(InvalidArgument) as caught:
        check(request_message)
    assert caught.value.status is grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.field == field
    assert caught.value.message.startswith(f"{field}: ")


def test_bad_values_are_quoted_in_the_message() -> None:
    with pytest.raises(InvalidArgument, match=r"params.top_p: must be in \(0, 1\], got 1.5"):
        check(pb.GenerateRequest(prompt="x", params=params(top_p=1.5)))
    with pytest.raises(InvalidArgument, match=rf"token id {VOCAB_SIZE} is outside the vocabulary \[0, {VOCAB_SIZE}\)"):
        check(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[VOCAB_SIZE])))


@pytest.mark.parametrize("request_id", ["", "x" * 129, "bad\nid"])
def test_bad_request_ids_are_named(request_id: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        request_id_of(pb.GenerateRequest(prompt="x", request_id=request_id), generated_id="gen")
    assert caught.value.field == "request_id"


def _with_unknown_field(message_bytes: bytes, number: int) -> bytes:
    """The message with a varint field `number` (one this server's schema does not define) appended."""
    tag = number << 3  # wire type 0: a varint
    encoded = bytearray()
    while True:
        byte, tag = tag & 0x7F, tag >> 7
        encoded.append(byte | (0x80 if tag else 0))
        if not tag:
            return message_bytes + bytes(encoded) + b"\x01"


def test_a_field_this_server_does_not_know_is_refused_by_number_never_dropped() -> None:
    # A client built from a newer proto sends a field this server's schema lacks: protobuf keeps it aside unread.
    top = pb.GenerateRequest.FromString(_with_unknown_field(pb.GenerateRequest(prompt="Hi").SerializeToString(), 900))
    with pytest.raises(InvalidArgument) as caught:
        submission_of(top, request_id="r1", vocab_size=VOCAB_SIZE)
    assert caught.value.field == "#900" and caught.value.status == grpc.StatusCode.INVALID_ARGUMENT
    params = pb.SamplingParams.FromString(_with_unknown_field(pb.SamplingParams(max_tokens=3).SerializeToString(), 77))
    nested = pb.GenerateRequest(prompt="Hi", params=params)
    with pytest.raises(InvalidArgument) as caught:
        submission_of(nested, request_id="r1", vocab_size=VOCAB_SIZE)
    assert caught.value.field == "params.#77"
    message = pb.ChatMessage.FromString(
        _with_unknown_field(pb.ChatMessage(role="user", content="hi").SerializeToString(), 31)
    )
    chat = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="system", content="s"), message]))
    with pytest.raises(InvalidArgument) as caught:
        submission_of(chat, request_id="r1", vocab_size=VOCAB_SIZE)
    assert caught.value.field == "chat.messages[1].#31"


def test_request_id_is_the_clients_or_the_generated_one() -> None:
    assert request_id_of(pb.GenerateRequest(prompt="x", request_id="mine-1"), generated_id="gen") == "mine-1"
    assert request_id_of(pb.GenerateRequest(prompt="x"), generated_id="gen") == "gen"


def test_defaults_when_nothing_is_set() -> None:
    submission = submission_of(pb.GenerateRequest(prompt="Hi"), request_id="r1", vocab_size=VOCAB_SIZE)
    assert submission.prompt == TextPrompt("Hi")
    assert submission.max_tokens is None
    assert submission.sampling == messages.SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0)
    assert submission.seed_given is False
    assert submission.stop_strings == () and submission.stop_token_ids == () and submission.ignore_eos is False
    submit = submission.to_submit_request([5, 6], eos_token_ids=[2])
    assert submit == messages.SubmitRequest(
        request_id="r1",
        prompt_token_ids=[5, 6],
        max_tokens=None,
        sampling=messages.SamplingParams(seed=0),
        stop_token_ids=[2],
        seed_given=False,
    )


def test_every_field_is_carried_over() -> None:
    request = pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")]),
        params=params(
            max_tokens=7, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=0, stop=["\n\n"], stop_token_ids=[5, 2]
        ),
    )
    submission = submission_of(request, request_id="r2", vocab_size=VOCAB_SIZE)
    assert submission.prompt == ChatPrompt((ChatMessage("user", "Hi"),))
    assert submission.seed_given is True  # seed 0 set explicitly is a given seed
    submit = submission.to_submit_request([1], eos_token_ids=[2])
    assert submit.max_tokens == 7
    assert submit.sampling == messages.SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=0)
    assert submit.stop_token_ids == [2, 5]  # eos first, no repeats
    assert submit.priority == 0
    prioritized = pb.GenerateRequest(prompt="Hi", priority=-7)
    assert submission_of(prioritized, request_id="r2", vocab_size=VOCAB_SIZE).to_submit_request([1], [2]).priority == -7
    assert submission.stop_strings == ("\n\n",)


def test_ignore_eos_leaves_only_the_clients_stop_ids() -> None:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1, 2, 3]), params=params(ignore_eos=True, stop_token_ids=[9])
    )
    submission = submission_of(request, request_id="r3", vocab_size=VOCAB_SIZE)
    assert submission.prompt == TokenPrompt((1, 2, 3))
    assert submission.to_submit_request([1, 2, 3], eos_token_ids=[2]).stop_token_ids == [9]


def test_edge_values_are_accepted() -> None:
    request = pb.GenerateRequest(prompt="x", params=params(temperature=0.0, top_p=1.0, top_k=0, max_tokens=1))
    assert submission_of(request, request_id="r4", vocab_size=VOCAB_SIZE).max_tokens == 1


# ---------------------------------------------------------------- tokenizer: chat template and eos ids


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.load(default_model_dir)


def test_vocab_and_eos_come_from_the_model_folder(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == VOCAB_SIZE
    assert tokenizer.eos_token_ids == (2,)


def test_chat_template_renders_like_transformers(tokenizer: Tokenizer, default_model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(default_model_dir))
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
    chat = [ChatMessage(**message) for message in conversation]
    expected_text = reference.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert tokenizer.render_chat(chat) == expected_text
    assert tokenizer.render_chat(chat).endswith("<|im_start|>assistant\n")
    assert tokenizer.encode_chat(chat) == reference.encode(expected_text, add_special_tokens=False)


def test_a_template_error_names_the_chat_field(tmp_path: Path, default_model_dir: Path) -> None:
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes((default_model_dir / name).read_bytes())
    chat = check(pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="a")])))
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": "{{ raise_exception(\'roles must alternate\') }}"}'
    )
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        Tokenizer.load(tmp_path).render_chat([ChatMessage("user", "a")])
    with pytest.raises(InvalidArgument, match="chat: .*roles must alternate"):
        prompt_token_ids_of(Tokenizer.load(tmp_path), chat.prompt, chat.prompt_field)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="the model has no chat template"):
        Tokenizer.load(tmp_path).encode_chat([ChatMessage("user", "a")])
    with pytest.raises(InvalidArgument, match="chat: the model has no chat template"):
        prompt_token_ids_of(Tokenizer.load(tmp_path), chat.prompt, chat.prompt_field)
