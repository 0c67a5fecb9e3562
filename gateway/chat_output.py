"""A chat answer's text as OpenAI's assistant message (docs/openai.md, "Tools" and "Reasoning"): a thinking
model's reasoning apart (`reasoning_content`, as vLLM and SGLang return it), then the model's tool calls
parsed out of the rest in its format (`tool_calls`, finish reason `tool_calls`), whole or streamed as
OpenAI streams them. The formats are the server's (GetServerMetadata: tool_call_format, reasoning_format)."""

from __future__ import annotations

from typing import Any

from moe_lightning.reasoning import ReasoningParser
from moe_lightning.tool_calls import ContentDelta, StreamingToolParser, parser_for


class ChatOutput:
    """One choice's answer. `tool_format`: parse tool calls ("": none asked); `reasoning_format`: split
    the reasoning off ("": the model has none)."""

    def __init__(self, tool_format: str, reasoning_format: str, template_kwargs: dict[str, Any] | None) -> None:
        self.tool_format = tool_format
        self.reasoning = (
            ReasoningParser(reasoning_format, template_kwargs=template_kwargs) if reasoning_format else None
        )
        self._stream: StreamingToolParser | None = None
        self.called = False  # a tool call was parsed: the finish reason is tool_calls

    def message(self, text: str) -> dict[str, Any]:
        """The whole answer as the message's fields."""
        out: dict[str, Any] = {"role": "assistant"}
        content: str | None = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text)
            if reasoning is not None:
                out["reasoning_content"] = reasoning
        if self.tool_format and content:
            parsed = parser_for(self.tool_format).parse(content)
            if parsed.tool_calls:
                self.called = True
                out["content"] = parsed.content or None
                out["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
                return out
        out["content"] = content  # None only where the reasoning took all of it, as vLLM gives it
        return out

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas of the next piece of the answer, each one chunk's `delta`."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        return self._deltas(reasoning, content, last=False)

    def finish(self) -> list[dict[str, Any]]:
        reasoning, content = self.reasoning.finish() if self.reasoning is not None else ("", "")
        return self._deltas(reasoning, content, last=True)

    def _deltas(self, reasoning: str, content: str, last: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"reasoning_content": reasoning}] if reasoning else []
        if not self.tool_format:
            if content:
                out.append({"content": content})
            return out
        if self._stream is None:
            self._stream = parser_for(self.tool_format).stream()
        pieces = self._stream.feed(content) if content else []
        if last:
            pieces += self._stream.finish()
        for piece in pieces:
            if isinstance(piece, ContentDelta):
                if piece.text:
                    out.append({"content": piece.text})
            else:
                self.called = True
                out.append({"tool_calls": [piece.to_openai()]})
        return out
