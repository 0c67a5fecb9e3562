"""A `messages` prompt of the public API as the domain conversation the chat template renders: the
messages (with an assistant's tool calls and reasoning, a tool's results), the tools and the template's
extra variables (docs/openai.md, "Chat templates" and "Tools"). Refused before anything is copied out
when no prompt could hold it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from moe_lightning.api.generation.v1 import generation_pb2
from moe_lightning.chat_template import (
    ChatMessage,
    ChatTemplateError,
    ToolCall,
    ToolSpec,
    check_template_kwargs,
    check_tool_name,
)
from moe_lightning.request import InvalidRequestError
from moe_lightning.validation import check_conversation_size


@dataclass(frozen=True, slots=True)
class Conversation:
    messages: list[ChatMessage]
    tools: list[ToolSpec] | None = None  # None: the template gets none (an empty list renders otherwise)
    template_kwargs: dict[str, Any] = field(default_factory=dict)


class _Contents(Sequence[str]):
    """The conversation's texts, read one at a time (each read copies one string out of the protobuf
    message): check_conversation_size stops at the first past the bound, so a conversation of many large
    messages is refused having copied little more than the bound. A message's text is its content, its
    reasoning and its calls' arguments; the tools' schemas and the template's variables count as one
    text each, after the messages."""

    def __init__(self, m: generation_pb2.ChatMessages) -> None:
        self._m = m

    def __len__(self) -> int:
        return len(self._m.messages) + 2

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        n = len(self._m.messages)
        if i < n:
            msg = self._m.messages[i]
            extra = [msg.reasoning_content] + [c.arguments for c in msg.tool_calls]
            return msg.content + "".join(extra) if any(extra) else msg.content
        if i == n:
            return "".join(t.description + t.parameters_json for t in self._m.tools)
        if i == n + 1:
            return self._m.template_kwargs_json
        raise IndexError(i)


def _message(msg: generation_pb2.ChatMessage) -> ChatMessage:
    for c in msg.tool_calls:  # the client's history: written raw into the template, as a tool's name is
        check_tool_name(c.name, "a tool call's function name")
    return ChatMessage(
        msg.role,
        msg.content,
        tool_calls=tuple(ToolCall(c.id, c.name, c.arguments or "{}") for c in msg.tool_calls),
        tool_call_id=msg.tool_call_id if msg.HasField("tool_call_id") else None,
        reasoning_content=msg.reasoning_content if msg.HasField("reasoning_content") else None,
    )


def _tool(t: generation_pb2.ToolSpec) -> ToolSpec:
    return ToolSpec(
        t.name,
        t.description if t.HasField("description") else None,
        t.parameters_json if t.HasField("parameters_json") else None,
    )


def conversation_from_pb(m: generation_pb2.ChatMessages, max_prompt_tokens: int | None) -> Conversation:
    if not m.messages:
        raise InvalidRequestError("messages is empty: give at least one message")
    check_conversation_size(_Contents(m), max_prompt_tokens)
    try:
        kwargs = json.loads(m.template_kwargs_json) if m.template_kwargs_json else {}
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(f"chat_template_kwargs is not JSON: {exc}") from None
    try:
        tools = [_tool(t) for t in m.tools] if m.has_tools or m.tools else None
        return Conversation([_message(msg) for msg in m.messages], tools, check_template_kwargs(kwargs))
    except ChatTemplateError as exc:  # a role no template takes, a tool's schema that is not JSON, ...
        raise InvalidRequestError(str(exc)) from None
