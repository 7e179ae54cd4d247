"""What output a request asks to follow, as each API writes it, and the grammars the gateway checks before submitting.

OpenAI: `response_format` `{"type": "json_object"}` or `{"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}` (`"text"`: no constraint). vLLM's extensions: `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` (Lark), and the newer `structured_outputs`
object with `json`, `regex`, `choice`, `grammar`. gRPC: `params.structured_output`. At most
one may be given. A spec that is not a grammar the model's tokenizer can follow (a schema
that is not a schema, a regex that does not compile) is refused naming its field.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from gateway.errors import InvalidArgument
from common.text.structured import (
    MAX_SPEC_CHARS,
    GrammarError,
    StructuredSpec,
    compile_spec,
    grammar_tokenizer,
    schema_of,
)
from common.text.tokenizer import Tokenizer

_COMPILED_KEPT = 256  # grammars kept compiled (clients repeat their schemas)

Asked = tuple[str, StructuredSpec]  # the field that asked, and what it asked for


class GrammarCompiler:
    """The model's tokenizer as llguidance reads it (built once), and the grammars checked so far."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = grammar_tokenizer(tokenizer.backend_json(), tokenizer.vocab_size, tokenizer.eos_token_ids)
        self._compiled: OrderedDict[StructuredSpec, str] = OrderedDict()

    def grammar(self, asked: Asked) -> str:
        """The grammar for the spec; raises InvalidArgument naming the field when it cannot be followed."""
        field, spec = asked
        grammar = self._compiled.pop(spec, None)
        if grammar is None:
            try:
                grammar = compile_spec(spec, self._tokenizer)
            except GrammarError as error:
                raise InvalidArgument(field, str(error)) from error
            except Exception as error:  # anything else the compiler raises is still this spec's fault, never a 500
                raise InvalidArgument(field, f"could not be compiled ({type(error).__name__})") from error
        self._compiled[spec] = grammar
        while len(self._compiled) > _COMPILED_KEPT:
            self._compiled.popitem(last=False)
        return grammar


class SpecError(ValueError):
    """A structured-output field of the wrong shape: `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def openai_structured(body: dict[str, Any]) -> Asked | None:
    """The one structured-output ask of an OpenAI body, if any; raises SpecError for a wrong shape or several asks."""
    asked: list[Asked] = []
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict) or response_format.get("type") not in (
            "text",
            "json_object",
            "json_schema",
        ):
            raise SpecError("response_format", 'must be {"type": "text" | "json_object" | "json_schema", ...}')
        if response_format["type"] == "json_object":
            asked.append(("response_format", StructuredSpec("json_object")))
        elif response_format["type"] == "json_schema":
            inner = response_format.get("json_schema")
            if not isinstance(inner, dict) or "schema" not in inner:
                raise SpecError("response_format.json_schema", "must be an object with a schema")
            asked.append(
                (
                    "response_format.json_schema.schema",
                    _json_spec("response_format.json_schema.schema", inner["schema"]),
                )
            )
    options = body.get("structured_outputs")
    if options is not None and not isinstance(options, dict):
        raise SpecError("structured_outputs", "must be an object")
    kinds = ("json", "regex", "choice", "grammar")
    fields = [(f"guided_{kind}", kind, body.get(f"guided_{kind}")) for kind in kinds]
    fields += [(f"structured_outputs.{kind}", kind, (options or {}).get(kind)) for kind in kinds]
    for field, kind, value in fields:
        if value is None:
            continue
        if kind == "json":
            asked.append((field, _json_spec(field, value)))
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise SpecError(field, "must be a non-empty list of non-empty strings")
            asked.append((field, StructuredSpec("choice", json.dumps(value))))
        else:
            if not isinstance(value, str) or not value:
                raise SpecError(field, "must be a non-empty string")
            asked.append((field, StructuredSpec("regex" if kind == "regex" else "grammar", value)))
    if len(asked) > 1:
        raise SpecError(asked[1][0], f"only one structured output may be asked for, and {asked[0][0]} is")
    return asked[0] if asked else None


def _json_spec(field: str, schema: object) -> StructuredSpec:
    """A schema given as an object (or as JSON text, as vLLM takes guided_json)."""
    return StructuredSpec("json_schema", json.dumps(parsed_schema(field, schema), sort_keys=True))


def parsed_schema(field: str, schema: object) -> dict[str, object] | bool:
    """A JSON Schema given as an object (a body's, already bounded by the body's depth) or as JSON text (vLLM's
    guided_json, SGLang's json_schema, gRPC's): the text's size and nesting are bounded before it is parsed, so
    nothing recurses past them; raises SpecError naming the field."""
    if isinstance(schema, str):
        if len(schema) > MAX_SPEC_CHARS:
            raise SpecError(field, f"is {len(schema)} characters long, at most {MAX_SPEC_CHARS}")
        try:
            return schema_of(schema)
        except GrammarError as error:
            raise SpecError(field, str(error)) from error
    if not isinstance(schema, (dict, bool)):
        raise SpecError(field, "must be a JSON Schema (an object)")
    return schema
