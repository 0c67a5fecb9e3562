"""A thinking model's reasoning, split from its answer: the OpenAI API's `reasoning_content`.

Thinking models (Qwen3, DeepSeek-R1) write their reasoning between `<think>` and `</think>` before
the answer (docs/openai.md). The split follows vLLM's qwen3 and deepseek_r1 reasoning parsers:

- Everything before the first `</think>` is reasoning, and everything after it the content, with no
  whitespace trimmed (Qwen3's content starts with the "\\n\\n" it writes after `</think>`).
- The answer need not open with `<think>`: a template may write it into the prompt (DeepSeek-R1's
  does, as Qwen3.5's), so reasoning is what comes first either way; a `<think>` the model writes
  itself is dropped (the first one before `</think>`; vLLM drops the text before it too, which the
  models do not write, and which a stream would have sent already).
- No `</think>` at all (the answer was cut short while thinking): all of it is reasoning.
- When the prompt already closed the reasoning, all of the answer is content: Qwen3's template, given
  `enable_thinking: false`, ends the prompt with an empty `<think>\\n\\n</think>\\n\\n`, and the
  model answers without thinking. The parser is told so by the rendered prompt (its end is
  `</think>` after whitespace, as vLLM's serving finds the reasoning ended in the prompt's tokens),
  or by the request's chat_template_kwargs (vLLM's qwen3 parser reads `enable_thinking`).

split() reads an answer whole; feed()/finish() read it as it streams, holding back text that may be
the start of a tag, and their pieces add up to split()'s, however the text is cut.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moe_lightning.config.choices import REASONING_FORMATS

FAMILIES = REASONING_FORMATS


@dataclass(frozen=True)
class _Family:
    start: str
    end: str
    reads_enable_thinking: bool  # whether chat_template_kwargs' enable_thinking turns thinking off


_FAMILIES = {
    "qwen3": _Family("<think>", "</think>", True),
    "deepseek_r1": _Family("<think>", "</think>", False),
}


def detect_reasoning(template_source: str) -> str | None:
    """The reasoning family a chat template writes for (None: no thinking tags in it)."""
    if "</think>" not in template_source:
        return None
    return "qwen3" if "enable_thinking" in template_source else "deepseek_r1"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is the start of `tag` (held back: it may be the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """One answer's reasoning and content. `prompt`: the rendered prompt, whose end tells whether
    the reasoning is closed already; `template_kwargs`: the request's chat_template_kwargs."""

    def __init__(
        self, family: str = "qwen3", *, prompt: str | None = None, template_kwargs: Mapping[str, Any] | None = None
    ) -> None:
        if family not in _FAMILIES:
            raise ValueError(f"unknown reasoning family {family!r}; known: {', '.join(FAMILIES)}")
        self.family = family
        self._f = _FAMILIES[family]
        self._prompt, self._kwargs = prompt, template_kwargs
        off = self._f.reads_enable_thinking and (template_kwargs or {}).get("enable_thinking") is False
        closed = prompt is not None and prompt.rstrip().endswith(self._f.end)
        # the reasoning is over before the answer starts: all of it is content
        self.thinking = not (off or closed)
        self._in_reasoning = self.thinking
        self._seen_start = False  # the answer's own <think> was dropped
        self._held = ""  # text that may be the start of a tag
        self._finished = False

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer: reasoning None when there was no thinking (the
        prompt closed it), content None when empty, as vLLM gives them."""
        p = ReasoningParser(self.family, prompt=self._prompt, template_kwargs=self._kwargs)
        r1, c1 = p.feed(text)
        r2, c2 = p.finish()
        reasoning, content = r1 + r2, c1 + c2
        return (reasoning if self.thinking else None), (content or None)

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning_delta, content_delta) of the next piece of the answer ("" for none)."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if not self._in_reasoning:
            return "", delta
        return self._read(self._held + delta, final=False)

    def finish(self) -> tuple[str, str]:
        """The end of the answer: a held back partial tag is text after all."""
        if self._finished:
            return "", ""
        self._finished = True
        if not self._in_reasoning:
            return "", ""
        return self._read(self._held, final=True)

    def _read(self, text: str, final: bool) -> tuple[str, str]:
        self._held = ""
        f = self._f
        reasoning = []
        while True:
            end = text.find(f.end)
            start = -1 if self._seen_start else text.find(f.start)
            if start >= 0 and (end < 0 or start < end):
                # the model's own opening tag: dropped, once
                reasoning.append(text[:start])
                text = text[start + len(f.start) :]
                self._seen_start = True
                continue
            if end >= 0:
                reasoning.append(text[:end])
                self._in_reasoning = False
                return "".join(reasoning), text[end + len(f.end) :]
            break
        if not final:
            hold = _partial_suffix(text, f.end)
            if not self._seen_start:
                hold = max(hold, _partial_suffix(text, f.start))
            if hold:
                self._held, text = text[-hold:], text[:-hold]
        reasoning.append(text)
        return "".join(reasoning), ""
