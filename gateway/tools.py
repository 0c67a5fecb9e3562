"""Tools on the chat API's request side (docs/openai.md, "Tools"): OpenAI's `tools`, `tool_choice` and
`parallel_tool_calls`, and the messages of a tool-call round trip (an assistant's tool_calls, a tool's
result), as the GenerationInput's conversation and, for tool_choice "required" or a named function,
the grammar that forces the calls in the model's own format (moe_lightning/tool_calls.call_grammar).
Each bad value is a 400 naming where it is."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.fields import UnsupportedField
from moe_lightning.api.generation.v1 import generation_pb2
from moe_lightning.chat_template import ChatTemplateError, ToolCall, ToolSpec

NO_FORMAT = (
    "this server parses no tool calls for its model: its chat template shows no tool-call format "
    "(start the server with --tool-call-parser hermes, mistral, llama3_json or harmony)"
)


def tool_specs(tools: Sequence[Any]) -> list[ToolSpec]:
    out = []
    for i, tool in enumerate(tools):
        try:
            out.append(ToolSpec.from_openai(tool))
        except ChatTemplateError as exc:
            raise UnsupportedField(f"tools.{i}", f"tools.{i}: {exc}") from None
    return out


def tool_calls_pb(calls: Sequence[Any], where: str) -> list[generation_pb2.ToolCall]:
    out = []
    for j, call in enumerate(calls):
        try:
            c = ToolCall.from_openai(call)
        except ChatTemplateError as exc:
            raise UnsupportedField(f"{where}.{j}", f"{where}.{j}: {exc}") from None
        out.append(generation_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments))
    return out


def tool_spec_pb(t: ToolSpec) -> generation_pb2.ToolSpec:
    m = generation_pb2.ToolSpec(name=t.name)
    if t.description is not None:
        m.description = t.description
    if t.parameters is not None:
        m.parameters_json = t.parameters
    return m


def check_tool_choice(choice: Any, tools: Sequence[ToolSpec]) -> None:
    if choice is None or choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise UnsupportedField("tool_choice", "tool_choice required needs tools to choose from")
        return
    if isinstance(choice, Mapping):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if choice.get("type") == "function" and isinstance(name, str):
            if not any(t.name == name for t in tools):
                raise UnsupportedField(
                    "tool_choice", f"tool_choice names the function {name!r}, which is not among the tools"
                )
            return
    raise UnsupportedField(
        "tool_choice",
        'tool_choice is "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
    )


def forcing_grammar(
    tool_format: str, tools: Sequence[ToolSpec], choice: Any, parallel: bool
) -> generation_pb2.Grammar | None:
    """The grammar of tool_choice "required" or a named function (None for none / auto)."""
    if choice is None or choice in ("none", "auto"):
        return None
    from moe_lightning.tool_calls import call_grammar

    try:
        grammar = call_grammar(tool_format, tools, choice, parallel)
    except ValueError as exc:
        raise UnsupportedField("tool_choice", str(exc)) from None
    return generation_pb2.Grammar(kind=generation_pb2.GRAMMAR_KIND_TOOL_CALLS, source=grammar.source())
