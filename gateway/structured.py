"""Structured output's request fields, OpenAI's and vLLM's, as the one grammar of a GenerationInput
(docs/structured-outputs.md): `response_format` json_object / json_schema, and vLLM's guided_json,
guided_regex and guided_choice. Their shape is checked here, with the field named; whether the grammar
library can compile one is the API's check (a 400 that names the problem)."""

from __future__ import annotations

import json
from typing import Any

from gateway.fields import UnsupportedField
from moe_lightning.api.generation.v1 import generation_pb2

GUIDED = ("guided_json", "guided_regex", "guided_choice")


def _schema_text(param: str, schema: Any) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise UnsupportedField(param, f"{param} is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise UnsupportedField(param, f"{param} must be a JSON schema (an object), got {type(schema).__name__}")
    return json.dumps(schema, ensure_ascii=False)


def response_format_grammar(value: dict[str, Any] | None) -> generation_pb2.Grammar | None:
    """OpenAI's response_format: text (none), json_object, or json_schema with its schema."""
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return generation_pb2.Grammar(kind=generation_pb2.GRAMMAR_KIND_JSON_OBJECT)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise UnsupportedField(
                "response_format.json_schema",
                "response_format json_schema needs json_schema: {name, schema, strict}, with the schema",
            )
        source = _schema_text("response_format.json_schema.schema", spec["schema"])
        return generation_pb2.Grammar(kind=generation_pb2.GRAMMAR_KIND_JSON_SCHEMA, source=source)
    raise UnsupportedField(
        "response_format.type", f"response_format.type must be text, json_object or json_schema, got {kind!r}"
    )


def guided_grammar(name: str, value: Any) -> generation_pb2.Grammar:
    if name == "guided_json":
        return generation_pb2.Grammar(kind=generation_pb2.GRAMMAR_KIND_JSON_SCHEMA, source=_schema_text(name, value))
    if name == "guided_regex":
        if not isinstance(value, str) or not value:
            raise UnsupportedField(name, "guided_regex must be a non-empty regular expression")
        return generation_pb2.Grammar(kind=generation_pb2.GRAMMAR_KIND_REGEX, source=value)
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise UnsupportedField(name, "guided_choice must be a non-empty list of non-empty strings")
    return generation_pb2.Grammar(kind=generation_pb2.GRAMMAR_KIND_CHOICE, source=json.dumps(value, ensure_ascii=False))


def request_grammar(response_format: dict[str, Any] | None, guided: dict[str, Any]) -> generation_pb2.Grammar | None:
    """The one grammar a body asks for (None: free text). `guided`: the guided_* fields that are set."""
    grammars = {}
    from_format = response_format_grammar(response_format)
    if from_format is not None:
        grammars["response_format"] = from_format
    for name, value in guided.items():
        if value is not None:
            grammars[name] = guided_grammar(name, value)
    if len(grammars) > 1:
        names = ", ".join(grammars)
        raise UnsupportedField(next(iter(grammars)), f"{names} each ask for a structure: set one of them")
    return next(iter(grammars.values()), None)
