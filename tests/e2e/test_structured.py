"""Structured output through a real stack: every answer follows what was asked, with and without speculation.

JSON schemas with nesting, enums, arrays and required fields, greedy and sampled, through
the official `openai` client: each answer parses and validates (jsonschema). The same
requests on a stack that never speculates give the same tokens: the tokens a grammar
forces are verified as draft tokens, and every verify row is masked as its decode step.
Regexes, choices and gRPC's structured_output too; a spec that is not one is a 400 (or
INVALID_ARGUMENT) naming its field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from proto import specserve_pb2 as pb
from specserve.stack import StackConfig
from tests.e2e.stack import Stack, running_stack
from tests.e2e.test_http_api import MODEL, call, client

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 30},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "status": {"type": "string", "enum": ["new", "paid", "shipped"]},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 8},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["id", "status", "items"],
        "additionalProperties": False,
    },
    "profile": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "handle": {"type": "string", "maxLength": 12},
                    "colours": {"type": "array", "maxItems": 3, "items": {"enum": ["red", "green", "blue"]}},
                },
                "required": ["handle", "colours"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
}
PROMPTS = {
    "person": "Describe a person called Ada, aged 36, as JSON.",
    "order": "Write an order for two apples as JSON.",
    "profile": "Make up a user profile as JSON.",
}


@pytest.fixture(scope="module")
def plain_stack(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack that never speculates: not even the tokens a grammar forces are verified ahead."""
    with running_stack(
        StackConfig(
            default_model_dir,
            dtype="float32",
            num_workers=1,
            max_num_seqs=8,
            scheduler_args=("--num-speculative-tokens", "0"),
        ),
        tmp_path_factory.mktemp("plain_stack"),
    ) as stack:
        yield stack


def schema_request(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS[name]}],
        "max_tokens": 160,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
        },
        **extra,
    }


def test_every_json_schema_answer_validates_and_speculation_changes_no_token(
    fp32_stack: Stack, plain_stack: Stack
) -> None:
    speculating, plain = client(fp32_stack), client(plain_stack)
    before = fp32_stack.info().speculation
    answers_by_name: dict[str, str] = {}
    for name, schema in SCHEMAS.items():
        for extra in ({"temperature": 0}, {"temperature": 0.8, "seed": 5}):
            answers = [api.chat.completions.create(**schema_request(name, **extra)) for api in (speculating, plain)]
            for answer in answers:
                choice = answer.choices[0]
                assert choice.finish_reason == "stop", (name, extra, choice.message.content)
                jsonschema.validate(json.loads(choice.message.content or ""), schema)
            assert answers[0].choices[0].message.content == answers[1].choices[0].message.content, (name, extra)
            if extra["temperature"] == 0:
                answers_by_name[name] = answers[0].choices[0].message.content or ""
    streamed = list(speculating.chat.completions.create(**schema_request("order", temperature=0), stream=True))
    text = "".join(event.choices[0].delta.content or "" for event in streamed if event.choices)
    assert text == answers_by_name["order"] and streamed[-1].choices[0].finish_reason == "stop"
    after = fp32_stack.info().speculation
    accepted = after.num_accepted_draft_tokens - before.num_accepted_draft_tokens
    proposed = after.num_draft_tokens - before.num_draft_tokens
    assert proposed > 0 and accepted == proposed  # the forced tokens: proposed by the grammar, always accepted
    assert plain_stack.info().speculation.num_draft_tokens == 0


def test_json_object_regex_and_choice_are_followed(fp32_stack: Stack) -> None:
    api = client(fp32_stack)
    answer = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me some JSON."}],
        max_tokens=120,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(answer.choices[0].message.content or ""), dict)
    else:  # an object the model never closes: cut by max_tokens, and said so
        assert answer.choices[0].finish_reason == "length"
    date = api.completions.create(
        model=MODEL,
        prompt="The date today is",
        max_tokens=20,
        temperature=0.7,
        seed=1,
        extra_body={"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"},
    )
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.choices[0].text) and date.choices[0].finish_reason == "stop"
    choice = api.completions.create(
        model=MODEL,
        prompt="Is the sky blue? Answer:",
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"choice": [" yes", " no", " maybe so"]}},
    )
    assert choice.choices[0].text in (" yes", " no", " maybe so")
    result = fp32_stack.generate(
        pb.GenerateRequest(
            prompt="Pick a colour:",
            params=pb.SamplingParams(
                max_tokens=10, structured_output=pb.StructuredOutput(choice=pb.Choices(choices=[" red", " green"]))
            ),
        )
    )
    assert result.text in (" red", " green") and result.finish_reason == pb.FINISH_REASON_STOP
    cut = api.completions.create(
        model=MODEL, prompt="Count:", max_tokens=3, temperature=0, extra_body={"guided_regex": "(one, ){20}done"}
    )
    assert cut.choices[0].finish_reason == "length"  # the grammar could not finish: never claimed complete


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"structured_outputs": {"grammar": "start: @@"}}, "structured_outputs.grammar"),
    ],
)
def test_a_spec_that_is_not_one_is_400_naming_its_field(fp32_stack: Stack, body: dict[str, Any], param: str) -> None:
    status, answer = call(fp32_stack, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 4, **body})
    assert status == 400 and isinstance(answer, dict) and answer["error"]["param"] == param, answer


def test_grpc_refuses_a_bad_schema_naming_the_field(fp32_stack: Stack) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        fp32_stack.generate(
            pb.GenerateRequest(
                prompt="x", params=pb.SamplingParams(structured_output=pb.StructuredOutput(json_schema='{"type": 5}'))
            )
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "params.structured_output.json_schema" in (caught.value.details() or "")
    with pytest.raises(openai.BadRequestError):
        client(fp32_stack).completions.create(model=MODEL, prompt="x", extra_body={"guided_regex": "("})
