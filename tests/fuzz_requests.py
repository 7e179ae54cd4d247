"""Hypothesis strategies for the public APIs' requests, shared by the in-process and the real-stack fuzz tests.

Every field comes as a client may get it right and as an attack run writes it: the wrong
type, huge, negative, NaN and infinite numbers, integers past 64 bits (and one literal of
5,000 digits, more than Python's int() reads), bools where integers go, digits that are
not ASCII, nested lists and objects, and structured-output specs nested past any limit.
Counts that would make a request long (max_tokens, n, prompts) are valid only when small,
so an example that is accepted finishes in a few tokens.

`answer_problem` says what is wrong with an HTTP answer: a 5xx, or a body (each event of a
stream) that a strict JSON parser refuses (NaN and Infinity are not JSON).
"""

from __future__ import annotations

import json
from typing import Any

import grpc
from hypothesis import strategies as st

from proto import specserve_pb2 as pb

MODEL = "SmolLM2-135M-Instruct"
Strategy = st.SearchStrategy[object]
BIG_INT = "\x00big-int\x00"  # a value written as an integer literal of 5,000 digits (body_text)
_BIG_DIGITS = "9" * 5000

_odd_numbers = st.sampled_from(
    [
        0,
        1,
        -1,
        2**31,
        2**63,
        2**64,
        10**30,
        1.5,
        2.5,
        -0.0,
        1e-300,
        1e308,
        float("nan"),
        float("inf"),
        float("-inf"),
        BIG_INT,
    ]
)
_odd_texts = st.sampled_from(["", "²", "١٢", "٣", "5", "-1", "--5", "nan", "x" * 300])
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6)
    | _odd_numbers
    | _odd_texts
)
WILD = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
# Anything but a valid large count: small ones, negative ones, ones past every bound, and every other type but null
# (a count left out is a long one: max_tokens until the context is full).
_not_integers = (
    st.booleans()
    | st.floats(allow_nan=True, allow_infinity=True)
    | _odd_texts
    | st.lists(st.integers(0, 3), max_size=2)
)
_past_bounds = st.sampled_from([2**31, 2**63, 2**64, 10**30, BIG_INT]) | st.integers(-(2**70), -1)


def small_count(most: int) -> st.SearchStrategy[object]:
    return st.integers(-2, most) | _past_bounds | _not_integers


NUMBER = _odd_numbers | st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**70), 2**70) | WILD
_deep_text = st.integers(60, 40_000).map(lambda n: "[" * n + "]" * n)


def _nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


SCHEMAS = st.sampled_from(
    [
        {"type": "object"},
        {"type": "integer", "minimum": 0, "maximum": 9},
        {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        {"enum": ["yes", "no"]},
        {"type": "nonsense"},
        {"$ref": "#/nowhere"},
        {"type": "number", "maximum": float("nan")},
    ]
)
SCHEMA_TEXTS = (
    SCHEMAS.map(json.dumps)
    | _deep_text
    | st.integers(20, 300).map(lambda n: json.dumps(_nested_schema(n)))
    | st.sampled_from(["{", "5", "[]", '{"type": "string", "maxLength": ' + "9" * 5000 + "}", "NaN"])
)
REGEXES = st.sampled_from(
    ["a+", "[0-9]{2}", "(", "(" * 300 + "a" + ")" * 300, "a{99999}", "", "\\", "[^\\x00]*", "(a|aa)*b"]
) | st.text(alphabet="ab()[]{}*+?|\\^$.,0123456789", max_size=20)
GRAMMARS = st.sampled_from(
    ['start: "a" | "b"', "start: @@", "start: " + "(" * 3000 + '"a"' + ")" * 3000, "", 'start: x\nx: x "a" | "b"']
) | st.text(max_size=20)
CHOICES = st.lists(st.text(max_size=4), max_size=3) | WILD


def _bodies(
    required: dict[str, Strategy], valid: dict[str, Strategy], attacks: dict[str, Strategy]
) -> st.SearchStrategy[dict[str, object]]:
    """A body of valid values (`required` always there, some of `valid`), then none, one or two of its fields given an
    attack's value instead: one alone is what finds a check that lets a value through."""
    base = st.fixed_dictionaries(required, optional=valid)
    one = st.sampled_from(sorted(attacks)).flatmap(lambda name: st.fixed_dictionaries({name: attacks[name]}))
    broken: st.SearchStrategy[dict[str, object]] = st.just({}) | one | st.builds(lambda a, b: {**a, **b}, one, one)
    return st.builds(lambda body, changes: {**body, **changes}, base, broken)


_VALID_SAMPLING = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 50),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 100),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stream": st.booleans(),
}
_VALID_OPENAI = {
    **_VALID_SAMPLING,
    "seed": st.integers(-(2**70), 2**70),
    "n": st.integers(1, 2),
    "model": st.just(MODEL),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=2),
    "min_tokens": st.integers(0, 1),
    "ignore_eos": st.booleans(),
    "user": st.text(max_size=4),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "guided_regex": st.sampled_from(["[a-z ]{1,8}", "(yes|no)"]),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
}
_ATTACKS_OPENAI = {
    "temperature": NUMBER,
    "top_p": NUMBER,
    "top_k": NUMBER,
    "min_p": NUMBER,
    "seed": NUMBER,
    "n": small_count(2),
    "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER,
    "repetition_penalty": NUMBER,
    "min_tokens": small_count(4),
    "logit_bias": st.dictionaries(
        st.sampled_from(["5", "²", "٣", "-1", "x", "99999999999", "--5", "1" * 20]), NUMBER, max_size=3
    )
    | WILD,
    "stop": WILD,
    "ignore_eos": WILD,
    "stream": WILD,
    "stream_options": WILD,
    "model": WILD,
    "suffix": WILD,
    "guided_json": SCHEMAS | SCHEMA_TEXTS | WILD,
    "guided_regex": REGEXES | WILD,
    "guided_choice": CHOICES,
    "guided_grammar": GRAMMARS | WILD,
    "response_format": st.builds(
        lambda schema: {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        SCHEMAS | SCHEMA_TEXTS | WILD,
    )
    | WILD,
    "structured_outputs": st.fixed_dictionaries(
        {}, optional={"json": SCHEMA_TEXTS, "regex": REGEXES, "choice": CHOICES, "grammar": GRAMMARS}
    )
    | WILD,
}


_BAD_PROMPT_IDS = st.lists(st.integers(-(2**70), 2**70) | st.booleans(), min_size=1, max_size=3)
_COMPLETIONS_ATTACKS = {
    **_ATTACKS_OPENAI,
    "prompt": WILD | _BAD_PROMPT_IDS,
    "max_tokens": small_count(4),
    "logprobs": small_count(5) | st.just(21),
    "echo": WILD,
    "best_of": small_count(2),
}
_CHAT_ATTACKS = {
    **_ATTACKS_OPENAI,
    "messages": WILD | st.lists(st.fixed_dictionaries({"role": WILD, "content": WILD}), max_size=2),
    "max_tokens": small_count(4),
    "max_completion_tokens": small_count(4),
    "logprobs": WILD,
    "top_logprobs": small_count(5),
}
_SGLANG_PARAM_ATTACKS = {
    **{
        name: NUMBER
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "sampling_seed",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
        )
    },
    "max_new_tokens": small_count(4),
    "min_new_tokens": small_count(4),
    "stop": WILD,
    "stop_token_ids": st.lists(st.integers(-1, 49152) | st.booleans() | NUMBER, max_size=3) | WILD,
    "ignore_eos": WILD,
    "skip_special_tokens": WILD,
    "regex": REGEXES | WILD,
    "json_schema": SCHEMAS | SCHEMA_TEXTS | WILD,
    "ebnf": WILD,
    "n": WILD,
    "no_stop_trim": WILD,
    "wibble": WILD,
}
_SGLANG_ATTACKS = {
    "sampling_params": WILD,
    "text": WILD,
    "input_ids": WILD | _BAD_PROMPT_IDS,
    "return_logprob": WILD,
    "top_logprobs_num": small_count(5),
    "logprob_start_len": NUMBER,
    "return_text_in_logprobs": WILD,
    "stream": WILD,
    "rid": WILD,
}


def completions_bodies() -> st.SearchStrategy[dict[str, object]]:
    """/v1/completions bodies; max_tokens is always there (a valid one small)."""
    prompt = (
        st.just("The capital of France is")
        | st.lists(st.integers(0, 49151), min_size=1, max_size=3)
        | st.lists(st.just("Hi"), min_size=2, max_size=2)
    )
    return _bodies(
        {"prompt": prompt, "max_tokens": st.integers(1, 4)},
        {**_VALID_OPENAI, "logprobs": st.integers(0, 5), "echo": st.booleans(), "best_of": st.just(2)},
        _COMPLETIONS_ATTACKS,
    )


def chat_bodies() -> st.SearchStrategy[dict[str, object]]:
    """/v1/chat/completions bodies; max_tokens is always there (a valid one small)."""
    messages = st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system"]),
                "content": st.just("Hi") | st.just([{"type": "text", "text": "Hi"}]),
            }
        ),
        min_size=1,
        max_size=2,
    )
    return _bodies(
        {"messages": messages, "max_tokens": st.integers(1, 4)},
        {**_VALID_OPENAI, "logprobs": st.booleans(), "max_completion_tokens": st.integers(1, 4)},
        _CHAT_ATTACKS,
    )


def sglang_bodies() -> st.SearchStrategy[dict[str, object]]:
    """/generate bodies; sampling_params.max_new_tokens is always there (a valid one small)."""
    params = _bodies(
        {"max_new_tokens": st.integers(0, 4)},
        {
            **_VALID_SAMPLING,
            "sampling_seed": st.integers(0, 2**64 - 1),
            "min_new_tokens": st.integers(0, 0),
            "stop_token_ids": st.lists(st.integers(0, 49151), max_size=2),
            "ignore_eos": st.booleans(),
            "skip_special_tokens": st.booleans(),
            "regex": st.sampled_from(["[a-z ]{1,8}", "(yes|no)"]),
        },
        _SGLANG_PARAM_ATTACKS,
    )
    prompt = st.builds(
        lambda text: {"text": text}, st.just("Hello") | st.lists(st.just("Hi"), min_size=1, max_size=3)
    ) | st.builds(lambda ids: {"input_ids": ids}, st.lists(st.integers(0, 49151), min_size=1, max_size=3))
    body = _bodies(
        {"sampling_params": params},
        {
            "return_logprob": st.booleans(),
            "top_logprobs_num": st.integers(0, 5),
            "logprob_start_len": st.integers(-1, 3),
            "return_text_in_logprobs": st.booleans(),
            "stream": st.booleans(),
            "rid": st.text(min_size=1, max_size=6),
        },
        _SGLANG_ATTACKS,
    )
    return st.builds(lambda first, rest: {**first, **rest}, prompt, body)


# One field at a time given each of these, the rest of a valid body as it is: what finds a check that lets one
# value through, every run, where a random draw finds it only sometimes.
HOSTILE = [
    1.5,
    2.0,
    -0.0,
    True,
    False,
    "5",
    "²",
    "",
    None,
    float("nan"),
    float("inf"),
    float("-inf"),
    1e-300,
    1e308,
    -1,
    0,
    2**31,
    2**63,
    2**64,
    -(2**64),
    10**30,
    BIG_INT,
    [1],
    [True],
    [[]],
    {"a": 1},
]
BASE_BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "The capital of France is", "max_tokens": 3, "logprobs": 2},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 2,
    },
    "/generate": {
        "text": "Hello",
        "sampling_params": {"max_new_tokens": 3},
        "return_logprob": True,
        "top_logprobs_num": 2,
    },
}
FIELDS_BY_PATH = {
    "/v1/completions": sorted(_COMPLETIONS_ATTACKS),
    "/v1/chat/completions": sorted(_CHAT_ATTACKS),
    "/generate": sorted(_SGLANG_ATTACKS) + [f"sampling_params.{name}" for name in sorted(_SGLANG_PARAM_ATTACKS)],
}


def one_field_attacks(path: str) -> list[tuple[str, dict[str, Any]]]:
    """(field, body) for each field of the API at `path` (a dotted name reaches into an object) with each HOSTILE
    value, in BASE_BODIES[path]."""
    bodies = []
    for field in FIELDS_BY_PATH[path]:
        for value in HOSTILE:
            body = json.loads(json.dumps(BASE_BODIES[path]))
            *outer, name = field.split(".")
            target = body
            for part in outer:
                target = target[part]
            target[name] = value
            bodies.append((field, body))
    return bodies


_int32 = st.integers(-(2**31), 2**31 - 1)
_double = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e-300, 1e308, -0.0])


def _structured_output() -> st.SearchStrategy[pb.StructuredOutput]:
    return st.one_of(
        st.builds(pb.StructuredOutput),
        st.builds(lambda v: pb.StructuredOutput(json_object=v), st.booleans()),
        st.builds(lambda v: pb.StructuredOutput(json_schema=v), SCHEMA_TEXTS | st.text(max_size=8)),
        st.builds(lambda v: pb.StructuredOutput(regex=v), REGEXES),
        st.builds(lambda v: pb.StructuredOutput(grammar=v), GRAMMARS),
        st.builds(
            lambda v: pb.StructuredOutput(choice=pb.Choices(choices=v)), st.lists(st.text(max_size=4), max_size=3)
        ),
    )


def grpc_requests() -> st.SearchStrategy[pb.GenerateRequest]:
    """GenerateRequests: valid ones, and ones with up to two fields at protobuf's extremes; max_tokens is always set (a
    valid one small)."""
    params = _bodies(
        {"max_tokens": st.integers(1, 4)},
        {
            **_VALID_SAMPLING,
            "seed": st.integers(0, 2**63 - 1),
            "stop_token_ids": st.lists(st.integers(0, 49151), max_size=2),
            "ignore_eos": st.booleans(),
            "logprobs": st.integers(0, 5),
            "min_tokens": st.integers(0, 1),
            "logit_bias": st.dictionaries(st.integers(0, 49151), st.floats(-100, 100), max_size=2),
        },
        {
            **{
                name: _double
                for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
            },
            "max_tokens": st.integers(-3, 4) | st.integers(-(2**31), -1),
            "top_k": _int32,
            "seed": st.integers(-(2**63), 2**63 - 1),
            "stop": st.lists(st.text(max_size=300), max_size=20),
            "stop_token_ids": st.lists(_int32, max_size=3),
            "logprobs": _int32,
            "prompt_logprobs": _int32,
            "logit_bias": st.dictionaries(_int32, _double, max_size=3),
            "min_tokens": _int32,
            "structured_output": _structured_output(),
        },
    )
    params = params.map(lambda fields: {name: value for name, value in fields.items() if name != "stream"})
    chat = st.builds(
        lambda role, content: {"chat": pb.ChatMessages(messages=[pb.ChatMessage(role=role, content=content)])},
        st.just("user") | st.text(max_size=3),
        st.text(max_size=8),
    )
    valid_input = (
        st.just({"prompt": "The capital of France is"})
        | chat
        | st.builds(
            lambda ids: {"token_ids": pb.TokenIds(ids=ids)}, st.lists(st.integers(0, 49151), min_size=1, max_size=3)
        )
    )
    bad_input: st.SearchStrategy[dict[str, object]] = st.one_of(
        st.just({}),
        st.builds(lambda text: {"prompt": text}, st.text(max_size=8)),
        st.builds(lambda ids: {"token_ids": pb.TokenIds(ids=ids)}, st.lists(_int32, max_size=3)),
    )
    request = _bodies(
        {"input": valid_input},
        {"request_id": st.text("abc-0123", min_size=1, max_size=8), "n": st.integers(1, 2)},
        {
            "input": bad_input,
            "request_id": st.text(max_size=8) | st.just("x" * 200),
            "n": st.integers(-3, 3) | st.integers(65, 2**31 - 1),
        },
    )
    return st.builds(_generate_request, request, params)


def _generate_request(fields: dict[str, Any], sampling: dict[str, Any]) -> pb.GenerateRequest:
    fields = dict(fields)
    return pb.GenerateRequest(**fields.pop("input"), **fields, params=pb.SamplingParams(**sampling))


def deep_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


ATTACKS = [  # (path, body text, the field named): each an observed 500 or hang
    ("/generate", {"text": "hi", "sampling_params": {"sampling_seed": 1.5}}, "sampling_params.sampling_seed"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [True]}}, "sampling_params.stop_token_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"min_new_tokens": 2.5}}, "sampling_params.min_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"sampling_seed": 2**64}}, "sampling_params.sampling_seed"),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": float("nan")}},
        "sampling_params.max_new_tokens",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": float("inf")}},
        "sampling_params.max_new_tokens",
    ),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": float("inf")}}, "sampling_params.top_k"),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"repetition_penalty": 1e-300}},
        "sampling_params.repetition_penalty",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"json_schema": "[" * 30_000 + "]" * 30_000}},
        "sampling_params.json_schema",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"json_schema": json.dumps(deep_schema(300))}},
        "sampling_params.json_schema",
    ),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"²": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 1e-300, "logprobs": 5}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "guided_json": "[" * 50_000 + "]" * 50_000}, "guided_json"),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": json.dumps(deep_schema(300))}},
        },
        "response_format.json_schema.schema",
    ),
]

# What gRPC may answer a client's request with: its own errors, never INTERNAL or UNKNOWN (or a DEADLINE_EXCEEDED).
CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE,
}


def body_text(body: object) -> str:
    """The body as JSON text (NaN and Infinity as Python writes them); BIG_INT as 5,000 digits."""
    return json.dumps(body).replace(json.dumps(BIG_INT), _BIG_DIGITS)


def strict_json(text: str) -> Any:
    """json.loads that refuses NaN, Infinity and -Infinity, as a strict client does."""

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def answer_problem(status: int, content_type: str, text: str) -> str:
    """What is wrong with an HTTP answer ("" when nothing is): not a 200 or 4xx, or not strict JSON."""
    if not (status == 200 or 400 <= status < 500):
        return f"status {status}: {text[:300]}"
    try:
        if content_type.startswith("text/event-stream"):
            events = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
            assert events[-1:] == ["[DONE]"], f"the stream did not end with [DONE]: {text[-300:]}"
            for event in events[:-1]:
                assert "error" not in strict_json(event), event  # every failure comes before the 200
        else:
            strict_json(text)
    except (ValueError, AssertionError) as error:
        return f"{error}: {text[:300]}"
    return ""
