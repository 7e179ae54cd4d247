"""The public edges under fuzzing, in process over real sockets with a scripted scheduler (tests/fuzz_requests.py).

Whatever a client sends to /v1/completions, /v1/chat/completions, SGLang's /generate or
gRPC's Generate is answered within a time bound with a 200 or a 4xx (gRPC: OK or a
client's error, never INTERNAL or UNKNOWN), in JSON a strict parser reads; whatever the
gateway accepts, the scheduler can read and accepts too. A structured-output spec is
compiled or refused naming its field, however deep it nests and whatever the grammar
compiler makes of it. Log-probabilities of -inf or NaN are written as a finite floor.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.api_error import ApiError
from gateway.errors import InvalidArgument, RequestFailed, UnreadableRequest
from gateway.generation import Generation
from gateway.grpc_request import structured_of, submission_of
from gateway.http_api import HttpApi
from gateway.metrics import GatewayMetrics
from gateway.openai_logprobs import LOGPROB_FLOOR
from gateway.openai_request import client_request_of
from gateway.request import TextPrompt
from gateway.request_stream import check_readable
from gateway.server import SpecServeServicer, add_servicer
from gateway.structured_request import GrammarCompiler, SpecError, openai_structured
from gateway.validation import validate
from common.text.tokenizer import Tokenizer
from proto import messages as m
from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc
from scheduler.admission import sampling_problem, token_problem
from tests.fuzz_requests import (
    ATTACKS,
    BASE_BODIES,
    CLIENT_ERRORS,
    MODEL,
    REGEXES,
    SCHEMA_TEXTS,
    SCHEMAS,
    WILD,
    answer_problem,
    body_text,
    chat_bodies,
    completions_bodies,
    deep_schema,
    grpc_requests,
    one_field_attacks,
    sglang_bodies,
    strict_json,
)

# The module-wide event loop, tokenizer and log set-up are the gateway server tests' fixtures.
from tests.unit.test_gateway_server import Harness, Script, gateway, logs_to_stderr, run, tokenizer  # noqa: F401

REPLY_TIMEOUT_S = 10.0  # in process, every answer comes in milliseconds: past this it is a hang
# Deterministic, so CI sees the same examples every run; the database off, so no run depends on an earlier one.
FUZZ = settings(
    max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
UNIT_FUZZ = settings(FUZZ, max_examples=300)
LOGPROBS = [-0.5, float("-inf"), float("nan")]  # what the scripted scheduler says, in turn


@pytest.fixture(scope="module")
def grammars(tokenizer: Tokenizer) -> GrammarCompiler:  # noqa: F811
    return GrammarCompiler(tokenizer)


def scored_script(tokenizer: Tokenizer, text: str = " Paris.") -> Script:  # noqa: F811
    """The scheduler's answer: `text` then eos (at most max_tokens of it), with log-probabilities when asked, some of
    them -inf and NaN."""
    ids = tokenizer.encode(text) + list(tokenizer.eos_token_ids)

    def entry(index: int, num_top: int) -> m.TokenLogprob:
        return m.TokenLogprob(LOGPROBS[index % 3], [m.TopLogprob(t, LOGPROBS[(index + t) % 3]) for t in range(num_top)])

    def script(submit: m.SubmitRequest) -> list[m.TokenDelta]:
        num_prompt = len(submit.prompt_token_ids)
        tokens = ids if submit.max_tokens is None else ids[: submit.max_tokens]
        prompt = (
            None
            if submit.prompt_logprobs is None
            else [entry(i, submit.prompt_logprobs) for i in range(num_prompt - 1)]
        )
        if not tokens:
            return [m.TokenDelta(submit.request_id, [], "length", num_prompt, 0, prompt_logprobs=prompt)]
        return [
            m.TokenDelta(
                submit.request_id,
                [token],
                None if i < len(tokens) - 1 else "stop" if token in tokenizer.eos_token_ids else "length",
                num_prompt,
                i + 1,
                logprobs=None if submit.logprobs is None else [entry(i, submit.logprobs)],
                prompt_logprobs=prompt if i == 0 else None,
            )
            for i, token in enumerate(tokens)
        ]

    return script


@dataclass
class Served:
    harness: Harness
    http_port: int
    stub: pb_grpc.SpecServeStub


@asynccontextmanager
async def served(tokenizer: Tokenizer, grammars: GrammarCompiler) -> AsyncIterator[Served]:  # noqa: F811
    """The HTTP APIs and gRPC, structured output served, on the scripted scheduler of the gateway server tests."""
    async with gateway(tokenizer, scored_script(tokenizer)) as harness:
        generation = Generation(tokenizer, harness.client, GatewayMetrics(), grammars)
        runner = HttpApi(generation, harness.reporter, MODEL).runner()
        await runner.setup()
        server = grpc.aio.server()
        add_servicer(server, SpecServeServicer(generation))
        grpc_port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            yield Served(harness, int(runner.addresses[0][1]), pb_grpc.SpecServeStub(channel))
        finally:
            await channel.close()
            await server.stop(None)
            await runner.cleanup()


@contextmanager
def running(run: Callable[[Any], Any], tokenizer: Tokenizer, grammars: GrammarCompiler) -> Iterator[Served]:  # noqa: F811
    """`served` held open across calls of `run` (each hypothesis example is one)."""
    manager = served(tokenizer, grammars)
    stack = run(manager.__aenter__())
    try:
        yield stack
    finally:
        run(manager.__aexit__(None, None, None))


async def post(port: int, path: str, text: str) -> tuple[int, str, str]:
    """Status, content type and body text, within REPLY_TIMEOUT_S."""
    async with asyncio.timeout(REPLY_TIMEOUT_S), aiohttp.ClientSession() as session:
        async with session.post(
            f"http://127.0.0.1:{port}{path}", data=text.encode(), headers={"Content-Type": "application/json"}
        ) as response:
            return response.status, response.content_type, await response.text()


def scheduler_refusal(submit: m.SubmitRequest, vocab_size: int) -> str:
    """Why the scheduler would refuse what the gateway accepted and sent ("" when it takes it)."""
    return sampling_problem(submit.sampling) or token_problem(submit, vocab_size)


# ---------------------------------------------------------------------------------------------------- structured output


@pytest.mark.parametrize(
    ("body", "field", "problem"),
    [
        ({"guided_json": "[" * 50_000 + "]" * 50_000}, "guided_json", "characters long"),
        ({"guided_json": "[" * 30_000 + "]" * 30_000}, "guided_json", "deeper than 64"),
        ({"guided_json": json.dumps(deep_schema(300))}, "guided_json", "deeper than 64"),
        ({"structured_outputs": {"json": json.dumps(deep_schema(70))}}, "structured_outputs.json", "deeper than 64"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": deep_schema(300)}}},
            "response_format.json_schema.schema",
            "deeper than 64",
        ),
        ({"guided_json": '{"type": "string", "maxLength": ' + "9" * 5000 + "}"}, "guided_json", "not JSON"),
        ({"guided_json": '{"type": "number", "maximum": NaN}'}, "guided_json", "NaN is not a JSON number"),
        ({"guided_regex": "(" * 300 + "a" + ")" * 300}, "guided_regex", "regex"),
        ({"guided_grammar": "start: " + "(" * 3000 + '"a"' + ")" * 3000}, "guided_grammar", "nested"),
    ],
)
def test_a_spec_nested_past_the_bound_is_refused_naming_its_field(
    grammars: GrammarCompiler, body: dict[str, Any], field: str, problem: str
) -> None:
    with pytest.raises((SpecError, InvalidArgument)) as refused:
        asked = openai_structured(body)
        assert asked is not None
        grammars.grammar(asked)
    assert getattr(refused.value, "field") == field and problem in str(refused.value)


@pytest.mark.parametrize("schema", ["[" * 30_000 + "]" * 30_000, json.dumps(deep_schema(300)), "[" * 50_000])
def test_a_grpc_schema_nested_past_the_bound_is_invalid_argument(grammars: GrammarCompiler, schema: str) -> None:
    params = pb.SamplingParams(structured_output=pb.StructuredOutput(json_schema=schema))
    with pytest.raises(InvalidArgument) as refused:
        asked = structured_of(params)
        assert asked is not None
        grammars.grammar(asked)
    assert refused.value.field == "params.structured_output.json_schema"


def test_a_spec_at_the_bound_compiles(grammars: GrammarCompiler) -> None:
    asked = openai_structured({"guided_json": json.dumps(deep_schema(62))})  # 63 levels with the innermost
    assert asked is not None and grammars.grammar(asked)


@UNIT_FUZZ
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "guided_json": SCHEMAS | SCHEMA_TEXTS | WILD,
            "guided_regex": REGEXES | WILD,
            "guided_grammar": WILD,
            "guided_choice": WILD,
            "response_format": WILD,
            "structured_outputs": WILD,
        },
    )
)
def test_any_openai_spec_compiles_or_is_refused_naming_its_field(
    grammars: GrammarCompiler, body: dict[str, Any]
) -> None:
    try:
        asked = openai_structured(body)
        if asked is not None:
            grammars.grammar(asked)
    except SpecError as error:
        assert error.field.split(".")[0] in body
    except InvalidArgument as error:
        assert error.field.split(".")[0] in body


@UNIT_FUZZ
@given(SCHEMA_TEXTS | REGEXES, st.sampled_from(["json_schema", "regex", "grammar"]))
def test_any_grpc_spec_compiles_or_is_invalid_argument(grammars: GrammarCompiler, value: str, kind: str) -> None:
    params = pb.SamplingParams(structured_output=pb.StructuredOutput(**{kind: value}))  # type: ignore[arg-type]
    try:
        asked = structured_of(params)
        if asked is not None:
            grammars.grammar(asked)
    except InvalidArgument as error:
        assert error.field == f"params.structured_output.{kind}"


# --------------------------------------------------------------------------------------------------- values, unit level


@UNIT_FUZZ
@given(completions_bodies())
def test_any_openai_body_is_a_request_the_scheduler_takes_or_a_400(tokenizer: Tokenizer, body: dict[str, Any]) -> None:  # noqa: F811
    body = json.loads(body_text(body).replace("9" * 5000, "9" * 50))  # as the server parses it, less the long literal
    try:
        request, fields = client_request_of(body, TextPrompt("x"), chat=False)
        submission = validate(request, fields=fields, request_id="r", vocab_size=tokenizer.vocab_size)
    except ApiError as error:
        assert error.status == 400
        return
    except RequestFailed as error:
        assert isinstance(error, InvalidArgument) and error.field, error
        return
    submit = submission.to_submit_request([1, 2], tokenizer.eos_token_ids)
    check_readable(submit)
    assert scheduler_refusal(submit, tokenizer.vocab_size) == ""


@UNIT_FUZZ
@given(grpc_requests())
def test_any_grpc_request_is_one_the_scheduler_takes_or_invalid_argument(
    tokenizer: Tokenizer,  # noqa: F811
    request: pb.GenerateRequest,
) -> None:
    try:
        submission = submission_of(request, request_id="r", vocab_size=tokenizer.vocab_size)
    except InvalidArgument as error:
        assert error.field
        return
    submit = submission.to_submit_request([1, 2], tokenizer.eos_token_ids)
    check_readable(submit)
    assert scheduler_refusal(submit, tokenizer.vocab_size) == ""


def test_the_attack_runs_values_are_400_naming_the_field(tokenizer: Tokenizer) -> None:  # noqa: F811
    attacks: list[tuple[dict[str, Any], str]] = [
        ({"logit_bias": {"²": 1}}, "logit_bias"),
        ({"logit_bias": {"--5": 1}}, "logit_bias"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"seed": 1.5}, "seed"),
        ({"top_k": float("inf")}, "top_k"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"temperature": 1e300}, "temperature"),
        ({"repetition_penalty": 10**400}, "repetition_penalty"),
    ]
    for body, field in attacks:
        with pytest.raises((ApiError, InvalidArgument)) as refused:
            request, fields = client_request_of({"prompt": "x", **body}, TextPrompt("x"), chat=False)
            validate(request, fields=fields, request_id="r", vocab_size=tokenizer.vocab_size)
        error = refused.value
        named = (
            error.param if isinstance(error, ApiError) else error.field if isinstance(error, InvalidArgument) else None
        )
        assert named == field, (body, refused.value)


def test_a_request_the_scheduler_could_not_read_fails_at_once_and_is_never_sent(
    run: Any,  # noqa: F811
    tokenizer: Tokenizer,
) -> None:  # noqa: F811
    unreadable = m.SubmitRequest("r", [1, 2], 4, m.SamplingParams(seed=1.5), [])  # type: ignore[arg-type]
    with pytest.raises(UnreadableRequest) as failure:
        check_readable(unreadable)
    assert failure.value.status == grpc.StatusCode.INTERNAL

    async def scenario() -> None:
        async with gateway(tokenizer, scored_script(tokenizer)) as harness:
            async with harness.client.open_request("r") as stream:
                with pytest.raises(UnreadableRequest):
                    await stream.submit(unreadable)
            assert harness.scheduler.submits() == []

    run(scenario())


# ---------------------------------------------------------------------------------------------------- over the sockets


def test_the_attack_runs_requests_are_400_naming_the_field_and_a_long_integer_too(
    run: Any,
    tokenizer: Tokenizer,  # noqa: F811
    grammars: GrammarCompiler,
) -> None:
    async def scenario() -> None:
        async with served(tokenizer, grammars) as s:
            for path, body, field in ATTACKS:
                status, _, text = await post(s.http_port, path, body_text(body))
                assert status == 400 and strict_json(text)["error"]["param"] == field, (body, text)
            long_literal = '{"prompt": "hi", "seed": ' + "1" * 5000 + "}"
            status, _, text = await post(s.http_port, "/v1/completions", long_literal)
            assert status == 400 and "more than 4300 digits" in strict_json(text)["error"]["message"]
            assert s.harness.scheduler.submits() == []

    run(scenario())


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "logprobs": 2, "echo": True}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "logprobs": 2, "stream": True}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2},
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "logprobs": True,
                "top_logprobs": 2,
                "stream": True,
            },
        ),
        (
            "/generate",
            {
                "text": "hi",
                "sampling_params": {"max_new_tokens": 3},
                "return_logprob": True,
                "top_logprobs_num": 2,
                "logprob_start_len": 0,
            },
        ),
        (
            "/generate",
            {
                "text": "hi",
                "sampling_params": {"max_new_tokens": 3},
                "return_logprob": True,
                "top_logprobs_num": 2,
                "stream": True,
            },
        ),
    ],
)
def test_infinite_and_nan_logprobs_are_written_as_the_floor(
    run: Any,
    tokenizer: Tokenizer,  # noqa: F811
    grammars: GrammarCompiler,
    path: str,
    body: dict[str, Any],
) -> None:
    async def scenario() -> None:
        async with served(tokenizer, grammars) as s:
            status, content_type, text = await post(s.http_port, path, json.dumps(body))
            assert status == 200 and answer_problem(status, content_type, text) == "", text
            numbers = {float(number) for number in re.findall(r"-?[0-9]+\.[0-9]+", text)}
            assert {LOGPROB_FLOOR, -0.5} <= numbers, text

    run(scenario())


@pytest.mark.parametrize("path", sorted(BASE_BODIES))
def test_every_field_given_each_hostile_value_is_answered_200_or_4xx_in_strict_json(
    run: Any,
    tokenizer: Tokenizer,  # noqa: F811
    grammars: GrammarCompiler,
    path: str,
) -> None:
    async def scenario() -> None:
        async with served(tokenizer, grammars) as s:
            at_once = asyncio.Semaphore(16)

            async def one(field: str, body: dict[str, Any]) -> str:
                async with at_once:
                    problem = answer_problem(*await post(s.http_port, path, body_text(body)))
                return f"{field}={body_text(body)[:200]}: {problem}" if problem else ""

            problems = await asyncio.gather(*(one(field, body) for field, body in one_field_attacks(path)))
            assert [problem for problem in problems if problem] == []
            assert not [
                p for submit in s.harness.scheduler.submits() if (p := scheduler_refusal(submit, tokenizer.vocab_size))
            ]

    run(scenario())


@pytest.mark.parametrize(
    ("path", "bodies"),
    [
        ("/v1/completions", completions_bodies()),
        ("/v1/chat/completions", chat_bodies()),
        ("/generate", sglang_bodies()),
    ],
    ids=["completions", "chat", "sglang"],
)
def test_fuzzed_http_requests_are_answered_200_or_4xx_in_strict_json(
    run: Any,
    tokenizer: Tokenizer,  # noqa: F811
    grammars: GrammarCompiler,
    path: str,
    bodies: st.SearchStrategy[dict[str, Any]],
) -> None:
    with running(run, tokenizer, grammars) as s:

        @FUZZ
        @given(bodies)
        def one(body: dict[str, Any]) -> None:
            status, content_type, text = run(post(s.http_port, path, body_text(body)))
            assert answer_problem(status, content_type, text) == "", body

        one()
        refused = [
            problem
            for submit in s.harness.scheduler.submits()
            if (problem := scheduler_refusal(submit, tokenizer.vocab_size))
        ]
        assert refused == []
        assert s.harness.scheduler.submits(), "no fuzzed request was accepted: the fuzz tests only refusals"


def test_fuzzed_grpc_requests_are_answered_ok_or_a_clients_error(
    run: Any,
    tokenizer: Tokenizer,  # noqa: F811
    grammars: GrammarCompiler,
) -> None:
    async def generate(stub: pb_grpc.SpecServeStub, request: pb.GenerateRequest) -> grpc.StatusCode:
        try:
            async for _ in stub.Generate(request, timeout=REPLY_TIMEOUT_S):
                pass
        except grpc.aio.AioRpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    with running(run, tokenizer, grammars) as s:

        @FUZZ
        @given(grpc_requests())
        def one(request: pb.GenerateRequest) -> None:
            code = run(generate(s.stub, request))
            assert code == grpc.StatusCode.OK or code in CLIENT_ERRORS, (code, request)

        one()
        assert not [
            p for submit in s.harness.scheduler.submits() if (p := scheduler_refusal(submit, tokenizer.vocab_size))
        ]
