"""What a request asks its output to match: a grammar's kind and source, checked without the library.

The API process builds a `GrammarSpec` from the request and carries `kind` and `source` over the wire
as two strings; only the head compiles it (compiler.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

# A schema or regex this large is an attack or a mistake, not a format: the library's compile time and
# memory grow with the source, and the head would pay them inside a step. 128 KiB holds any realistic
# schema (OpenAI caps a strict schema at 100 object properties and 5 levels of nesting).
MAX_SOURCE_CHARS = 128 * 1024

# Distinct choices of a choice grammar: each is an item of the parser's row, whose limit is 2,000
# (grammar/limits.py); 1,000 is OpenAI's bound on a strict schema's enum values, with room to spare.
MAX_CHOICES = 1000

TOOL_CALL_KEYS = ("begin", "separator", "end", "schema")


class GrammarError(ValueError):
    """A grammar that cannot be compiled; the message names the problem (an HTTP 400's text)."""


class GrammarKind(StrEnum):
    JSON_OBJECT = "json_object"  # any JSON object: OpenAI's response_format json_object
    JSON_SCHEMA = "json_schema"  # response_format json_schema, vLLM's guided_json
    REGEX = "regex"  # vLLM's guided_regex: the whole output matches
    CHOICE = "choice"  # vLLM's guided_choice: the output is one of the strings
    TOOL_CALLS = "tool_calls"  # tool_choice required / named: begin + call + (separator + call)* + end


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """`source` by kind: "" (json_object); the schema's JSON text (json_schema); the regex (regex); a
    JSON list of strings (choice); a JSON object {"begin", "separator", "end": str, "schema": the JSON
    schema of one call} (tool_calls). Hashable: the compiler caches by it."""

    kind: GrammarKind
    source: str = ""

    def __post_init__(self) -> None:
        # the wire carries the kind as a string; accept one and store the enum
        if not isinstance(self.kind, GrammarKind):
            try:
                object.__setattr__(self, "kind", GrammarKind(self.kind))
            except ValueError:
                kinds = ", ".join(k.value for k in GrammarKind)
                raise GrammarError(f"unknown grammar kind {self.kind!r}; choose one of {kinds}") from None
        if not isinstance(self.source, str):
            raise GrammarError(f"{self.kind} grammar: source must be a string, got {type(self.source).__name__}")
        if len(self.source) > MAX_SOURCE_CHARS:
            raise GrammarError(
                f"{self.kind} grammar: source is {len(self.source)} characters, "
                f"more than the {MAX_SOURCE_CHARS} allowed"
            )
        _CHECKS[self.kind](self.source)

    # ---- constructors from the request's objects (compact JSON: the cache keys on the text) ----------
    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls(GrammarKind.JSON_OBJECT, "")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> GrammarSpec:
        return cls(GrammarKind.JSON_SCHEMA, schema if isinstance(schema, str) else _dumps(schema))

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls(GrammarKind.REGEX, pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> GrammarSpec:
        return cls(GrammarKind.CHOICE, _dumps(list(choices)))

    @classmethod
    def tool_calls(
        cls, schema: Mapping[str, Any], *, begin: str = "", separator: str | None = "", end: str = ""
    ) -> GrammarSpec:
        return cls(
            GrammarKind.TOOL_CALLS, _dumps({"begin": begin, "separator": separator, "end": end, "schema": schema})
        )

    def parsed(self) -> Any:
        """The source decoded: None (json_object, regex: the text is the grammar), the schema dict, the
        list of choices, or the tool-calls dict."""
        if self.kind in (GrammarKind.JSON_OBJECT, GrammarKind.REGEX):
            return None
        return json.loads(self.source)

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind.value, "source": self.source}, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> GrammarSpec:
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise GrammarError(f"grammar spec is not valid JSON: {exc}") from None
        if not isinstance(obj, dict) or set(obj) != {"kind", "source"}:
            raise GrammarError('grammar spec must be a JSON object {"kind": ..., "source": ...}')
        return cls(obj["kind"], obj["source"])


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _load(kind: GrammarKind, source: str, what: str) -> Any:
    try:
        return json.loads(source)
    except ValueError as exc:
        raise GrammarError(f"{kind} grammar: {what} is not valid JSON: {exc}") from None


def _check_json_object(source: str) -> None:
    if source:
        raise GrammarError("json_object grammar: source must be empty (any JSON object matches)")


def _check_schema(source: str) -> None:
    if not isinstance(_load(GrammarKind.JSON_SCHEMA, source, "the schema"), dict):
        raise GrammarError("json_schema grammar: the schema must be a JSON object")


def _check_regex(source: str) -> None:
    # the syntax is the library's (Rust regex: no look-around, no backreferences); compile checks it
    if not source:
        raise GrammarError("regex grammar: the regex is empty")


def _check_choice(source: str) -> None:
    choices = _load(GrammarKind.CHOICE, source, "the choices")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError("choice grammar: the choices must be a non-empty JSON list of strings")
    distinct = len(set(choices))  # a repeated choice is compiled once (compiler.grammar_text)
    if distinct > MAX_CHOICES:
        raise GrammarError(f"choice grammar: {distinct} distinct choices, more than the {MAX_CHOICES} allowed")


def _check_tool_calls(source: str) -> None:
    spec = _load(GrammarKind.TOOL_CALLS, source, "the source")
    if not isinstance(spec, dict) or set(spec) != set(TOOL_CALL_KEYS):
        raise GrammarError(f"tool_calls grammar: source must be a JSON object with exactly the keys {TOOL_CALL_KEYS}")
    for key in TOOL_CALL_KEYS[:3]:
        # a null separator: exactly one call (a named function, or no parallel calls)
        if not isinstance(spec[key], str) and not (key == "separator" and spec[key] is None):
            raise GrammarError(f"tool_calls grammar: {key!r} must be a string")
    if not isinstance(spec["schema"], dict):
        raise GrammarError("tool_calls grammar: 'schema' (one call's JSON schema) must be a JSON object")


_CHECKS = {
    GrammarKind.JSON_OBJECT: _check_json_object,
    GrammarKind.JSON_SCHEMA: _check_schema,
    GrammarKind.REGEX: _check_regex,
    GrammarKind.CHOICE: _check_choice,
    GrammarKind.TOOL_CALLS: _check_tool_calls,
}
