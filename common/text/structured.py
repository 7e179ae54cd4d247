"""Structured output: what a request's output must match, as an llguidance grammar, and the grammar's token masks.

A client asks for JSON (any object, or one matching a JSON schema), a regular expression,
one of a few strings, or a Lark grammar. Each becomes llguidance's grammar text, checked
against the model's tokenizer when the request arrives. We chose llguidance over
outlines-core and xgrammar (bench/grammar_mask.py, docs/benchmarks.md): a schema compiles
in under 2 ms, where outlines-core builds a whole automaton per schema (0.3-1.2 s here,
for every new schema a client sends); its mask costs 0.08-0.24 ms per token on average
(outlines-core's 0.02-0.1 ms, once compiled), under 1% of a decode step; it rolls back
consumed tokens, which rejected draft tokens need; it says which tokens the grammar forces
next (proposed as draft tokens); and it needs neither torch nor transformers, where
xgrammar needs both and triton.

JSON is generated compactly (no whitespace between tokens), so the grammar forces every
key and separator and those tokens cost no step of their own.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import llguidance

from common.json_depth import nests_deeper_than

Kind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]
MAX_SPEC_CHARS = 65536  # a schema, regex or grammar larger than this is refused
# How deep a schema's JSON may nest, checked on its text before anything parses it: Python's json recurses once per
# level, and llguidance reads the schema and then the grammar wrapping it with serde_json, which refuses past 128
# levels (a ValueError). The HTTP body's own limit (gateway/http_body.py), so a schema sent inline always fits.
MAX_SCHEMA_DEPTH = 64


class GrammarError(ValueError):
    """The spec is not a grammar the server can follow; the message says why."""


@dataclass(frozen=True)
class StructuredSpec:
    """What the output must match: `value` is the schema (JSON text), the regex, the choices (a JSON list) or the
    Lark grammar; unused for json_object."""

    kind: Kind
    value: str = ""


def grammar_text(spec: StructuredSpec) -> str:
    """llguidance's grammar for the spec (not yet checked against a tokenizer: `grammar_problem`)."""
    if len(spec.value) > MAX_SPEC_CHARS:
        raise GrammarError(f"is {len(spec.value)} characters long, at most {MAX_SPEC_CHARS}")
    try:
        return _grammar_text(spec)
    except GrammarError:
        raise
    except (ValueError, TypeError, RecursionError) as error:  # what llguidance raises for a spec it cannot read
        raise GrammarError(str(error)[:_MAX_ERROR_CHARS] or type(error).__name__) from error


def schema_of(text: str) -> dict[str, object] | bool:
    """A JSON Schema's text parsed, its nesting bounded before it is (MAX_SCHEMA_DEPTH); raises GrammarError."""
    if nests_deeper_than(text, MAX_SCHEMA_DEPTH):
        raise GrammarError(f"nests arrays and objects deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        schema = json.loads(text, parse_constant=_refuse_constant)
    except ValueError as error:  # not JSON, or an integer longer than int() reads
        raise GrammarError(f"is not JSON: {error}") from error
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("must be a JSON Schema (an object)")
    return schema


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _grammar_text(spec: StructuredSpec) -> str:
    match spec.kind:
        case "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                '{"type": "object"}', defaults={"whitespace_flexible": False}
            )
        case "json_schema":
            schema = schema_of(spec.value)
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults={"whitespace_flexible": False}
            )
        case "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.value)
        case "choice":
            choices = json.loads(spec.value)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise GrammarError("must be a non-empty list of non-empty strings")
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        case "grammar":
            return llguidance.LLMatcher.grammar_from_lark(spec.value)


def grammar_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """The model's tokenizer as llguidance reads it (about 0.5 s to build: keep it). Ids past the tokenizer's own, up
    to the model's vocab_size, are never allowed."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)


def grammar_problem(grammar: str, tokenizer: llguidance.LLTokenizer) -> str:
    """Why the grammar cannot be followed with this tokenizer ("" when it can)."""
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    except (ValueError, TypeError) as exc:  # a grammar text llguidance cannot even read
        return str(exc)
    return str(error).strip()


def compile_spec(spec: StructuredSpec, tokenizer: llguidance.LLTokenizer) -> str:
    """The spec's grammar, checked; raises GrammarError saying what is wrong with it."""
    grammar = grammar_text(spec)
    if problem := grammar_problem(grammar, tokenizer):
        raise GrammarError(" ".join(line.strip() for line in problem.splitlines() if line.strip())[:_MAX_ERROR_CHARS])
    return grammar


_MAX_ERROR_CHARS = 400
