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

GPT-OSS (`gpt_oss`) writes no tags but harmony messages (docs/openai.md, "Harmony"): the prompt ends
with `<|start|>assistant`, and the answer goes on with the first message's header,
`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`.
As vLLM's gpt-oss parser splits it: the `analysis` channel's text is reasoning, the `final` channel's
and the `commentary` channel's without a recipient (a preamble: shown to the user) is content, messages
of one kind joined by "\n". A message to a function (`to=functions.NAME`) is a tool call: it goes to
the content as written, header and all, for the `harmony` tool parser (moe_lightning.tool_calls) to
read; a message to another recipient (a built-in tool this server does not run) is reasoning.
The markers are special tokens of GPT-OSS's tokenizer, so they are in the text only when the output
is decoded keeping special tokens (KEEPS_SPECIAL_TOKENS). Decoded without them, the answer reads
`analysis...assistantfinal...`: that is split too, by the channel names after "assistant" (a model
that wrote "assistantfinal" in its thinking would be cut there; tool calls cannot be read then).
An answer that opens with neither is no harmony at all, and is all content.

split() reads an answer whole; feed()/finish() read it as it streams, holding back text that may be
the start of a tag, and their pieces add up to split()'s, however the text is cut.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from moe_lightning.config.choices import REASONING_FORMATS

FORMATS = REASONING_FORMATS  # every format ReasoningParser reads
GPT_OSS = "gpt_oss"
# the formats whose markers are special tokens, so the output must be decoded keeping them for the
# parser to see them (the request's skip_special_tokens false; Qwen3's <think> is no special token)
KEEPS_SPECIAL_TOKENS = frozenset({GPT_OSS})


@dataclass(frozen=True)
class _Family:
    start: str
    end: str
    reads_enable_thinking: bool  # whether chat_template_kwargs' enable_thinking turns thinking off


_FAMILIES = {
    "qwen3": _Family("<think>", "</think>", True),
    "deepseek_r1": _Family("<think>", "</think>", False),
}
FAMILIES = tuple(_FAMILIES)  # the formats that think between <think> tags (the others: gpt_oss)


def detect_reasoning(template_source: str) -> str | None:
    """The reasoning format a chat template writes for (None: no thinking tags or channels in it)."""
    if HARMONY_CHANNEL in template_source and "analysis" in template_source:
        return GPT_OSS
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
    the reasoning is closed already (gpt_oss: whether it opened the first message, up to its
    `<|message|>`, itself); `template_kwargs`: the request's chat_template_kwargs."""

    def __init__(
        self, family: str = "qwen3", *, prompt: str | None = None, template_kwargs: Mapping[str, Any] | None = None
    ) -> None:
        if family not in FORMATS:
            raise ValueError(f"unknown reasoning family {family!r}; known: {', '.join(FORMATS)}")
        self.family = family
        self._prompt, self._kwargs = prompt, template_kwargs
        # gpt_oss: harmony's channels, read by _HarmonySplit; the model always has its analysis channel
        # (reasoning_effort low still thinks), so nothing turns the reasoning off
        self._harmony = _HarmonySplit(prompt) if family == GPT_OSS else None
        if self._harmony is not None:
            self._f = _Family("", "", False)  # never read: the <think> path is not taken
            self.thinking = True
        else:
            self._f = _FAMILIES[family]
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
        if self._harmony is not None:  # as vLLM's gpt-oss parser: None for none, as for the content
            return (reasoning or None), (content or None)
        return (reasoning if self.thinking else None), (content or None)

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning_delta, content_delta) of the next piece of the answer ("" for none)."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if self._harmony is not None:
            return self._harmony.read(delta, final=False)
        if not self._in_reasoning:
            return "", delta
        return self._read(self._held + delta, final=False)

    def finish(self) -> tuple[str, str]:
        """The end of the answer: a held back partial tag is text after all."""
        if self._finished:
            return "", ""
        self._finished = True
        if self._harmony is not None:
            return self._harmony.read("", final=True)
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


# ---- harmony (GPT-OSS) -------------------------------------------------------------------------------
# Read here for both parsers: the reasoning's split (below) and the `harmony` tool calls
# (moe_lightning.tool_calls), which read the same messages out of the content.

HARMONY_START = "<|start|>"
HARMONY_END = "<|end|>"
HARMONY_MESSAGE = "<|message|>"
HARMONY_CHANNEL = "<|channel|>"
HARMONY_CONSTRAIN = "<|constrain|>"
HARMONY_RETURN = "<|return|>"
HARMONY_CALL = "<|call|>"
FUNCTIONS = "functions."  # the namespace of the request's tools, as the template declares them
# A header longer than this is no header (the text is content): the longest real one is a role, a
# recipient with a function's name, a channel and a content type; without a bound a model that wrote
# "<|start|>" and never "<|message|>" would have its whole answer held back
MAX_HEADER = 1024
# what ends a message's body: its end, a stop token left in the text, or the next message's start
# (a model that left out <|end|>)
_BODY_ENDS = (HARMONY_END, HARMONY_CALL, HARMONY_RETURN, HARMONY_START)
# what cannot be in a header: a header that meets one of them before <|message|> is text
_NOT_IN_HEADER = (HARMONY_START, HARMONY_END, HARMONY_CALL, HARMONY_RETURN)
# how a header may open right at the answer's start, where the prompt wrote `<|start|>assistant`: with
# its channel, or with a recipient after the role (`<|start|>assistant to=functions.f<|channel|>...`)
HEADER_OPENERS = (HARMONY_CHANNEL, " to=")
_HEADER_TOKEN = re.compile(r"<\|(channel|constrain)\|>|to=([^\s<]*)|([^\s<]+)|\s+|<")


@dataclass(frozen=True)
class HarmonyHeader:
    """One message's header: `raw` as written, from its `<|start|>` (where it has one) to its
    `<|message|>`, and what it says (None: not said)."""

    raw: str
    role: str | None
    channel: str | None
    recipient: str | None  # `to=...`, in the role's part or the channel's
    content_type: str | None  # `<|constrain|>json`, or the word after the channel (`commentary json`)

    @property
    def function(self) -> str | None:
        """The function it calls (`to=functions.NAME`), else None."""
        if self.recipient is None or not self.recipient.startswith(FUNCTIONS):
            return None
        return self.recipient[len(FUNCTIONS) :] or None


def parse_header(raw: str) -> HarmonyHeader:
    """`raw`: a header as HarmonyReader found it (ending with `<|message|>`)."""
    body = raw.removesuffix(HARMONY_MESSAGE)
    expect: str | None = None
    if body.startswith(HARMONY_START):
        body, expect = body[len(HARMONY_START) :], "role"
    found: dict[str, str | None] = {"role": None, "channel": None, "recipient": None, "type": None}
    for m in _HEADER_TOKEN.finditer(body):
        marker, recipient, word = m.groups()
        if marker is not None:
            expect = "channel" if marker == "channel" else "type"
        elif recipient is not None:
            found["recipient"], expect = recipient or None, None
        elif word is not None:
            if expect is not None:
                found[expect] = word
            elif found["channel"] is not None and found["type"] is None:
                found["type"] = word  # "commentary json", as GPT-OSS's template writes a call
            expect = None
    return HarmonyHeader(raw, found["role"], found["channel"], found["recipient"], found["type"])


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How much of the end of `text` may be the start of one of `markers` (held back)."""
    if "<" not in text[-12:]:  # every marker starts with "<" and is shorter than that
        return 0
    return max(_partial_suffix(text, m) for m in markers)


def _first(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """The first of `markers` in text[start:]: (its position, it), or (-1, "")."""
    best, which = -1, ""
    for m in markers:
        j = text.find(m, start)
        if j >= 0 and (best < 0 or j < best):
            best, which = j, m
    return best, which


@dataclass(frozen=True)
class HarmonyEvent:
    """What HarmonyReader read: `text` outside any message; a message's `header`; a piece of its
    `body`; its `end` (the terminator as written, "" where the next message's start or the answer's end
    ended it)."""

    kind: Literal["text", "header", "body", "end"]
    text: str = ""
    header: HarmonyHeader | None = None


class HarmonyReader:
    """Harmony messages in a text that comes in pieces: feed() each piece (final=True at the end),
    each returning the events it decided. Text that may be the start of a marker is held back, and a
    header is held whole until its `<|message|>`; the events are the same however the text is cut.
    `state`: where the text starts: between messages ("text"), in a header ("header": the prompt wrote
    the `<|start|>assistant` before it), or in a message's body ("body")."""

    def __init__(self, state: Literal["text", "header", "body"] = "text") -> None:
        self._state = state
        self._buf = ""  # held back: the start of a marker, or the header read so far

    def feed(self, text: str, final: bool = False) -> list[HarmonyEvent]:
        out: list[HarmonyEvent] = []
        s, self._buf = self._buf + text, ""
        i = 0
        while True:
            if self._state == "text":
                j = s.find(HARMONY_START, i)
                if j < 0:
                    hold = 0 if final else _held(s[i:], (HARMONY_START,))
                    self._emit(out, "text", s[i : len(s) - hold])
                    self._buf = s[len(s) - hold :]
                    return out
                self._emit(out, "text", s[i:j])
                s, i, self._state = s[j:], 0, "header"
            elif self._state == "header":
                s, i = s[i:], 0
                window = s[:MAX_HEADER]  # what is past it cannot make this a header
                k = window.find(HARMONY_MESSAGE)
                bad, _ = _first(window, _NOT_IN_HEADER, 1)  # (a <|start|> at 0 opens it)
                if k >= 0 and (bad < 0 or k < bad):
                    raw = s[: k + len(HARMONY_MESSAGE)]
                    out.append(HarmonyEvent("header", header=parse_header(raw)))
                    s, self._state = s[len(raw) :], "body"
                    continue
                if bad < 0 and len(s) < MAX_HEADER and not final:
                    self._buf = s  # the header goes on
                    return out
                # no header: text up to the marker that broke it (read again, as text), up to the
                # bound (but for a <|start|> the bound cut, read again), or all of it at the end
                if bad >= 0:
                    cut = bad
                elif len(s) >= MAX_HEADER:
                    cut = MAX_HEADER - _held(window, (HARMONY_START,))
                else:
                    cut = len(s)
                self._emit(out, "text", s[:cut])
                s, self._state = s[cut:], "text"
            else:  # body
                j, end = _first(s, _BODY_ENDS, i)
                if j < 0:
                    hold = 0 if final else _held(s[i:], _BODY_ENDS)
                    self._emit(out, "body", s[i : len(s) - hold])
                    self._buf = s[len(s) - hold :]
                    if final:
                        out.append(HarmonyEvent("end"))
                        self._state = "text"
                    return out
                self._emit(out, "body", s[i:j])
                if end == HARMONY_START:
                    out.append(HarmonyEvent("end"))
                    s, i, self._state = s[j:], 0, "header"
                else:
                    out.append(HarmonyEvent("end", end))
                    s, i, self._state = s, j + len(end), "text"

    @staticmethod
    def _emit(out: list[HarmonyEvent], kind: Literal["text", "body"], text: str) -> None:
        if text:
            out.append(HarmonyEvent(kind, text))


def opens_header(text: str, final: bool) -> bool | None:
    """Whether an answer that starts with `text` opens with a header (HEADER_OPENERS); None while it
    may still (wait for more, unless `final`)."""
    if text.startswith(HEADER_OPENERS):
        return True
    if not final and any(o.startswith(text) for o in HEADER_OPENERS):
        return None
    return False


# The answer decoded without special tokens: each message's header is its channel's name right after
# the role, "assistant" (the first one's role was the prompt's)
_STRIPPED_CHANNELS = ("analysis", "commentary", "final")
_STRIPPED_STARTS = tuple("assistant" + c for c in _STRIPPED_CHANNELS)
# how a gpt_oss answer may open: a header (the prompt's `<|start|>assistant` before it), a message of
# its own, or, without the special tokens, a channel's name
_OPENERS = (*HEADER_OPENERS, HARMONY_START, *_STRIPPED_CHANNELS)


class _HarmonySplit:
    """gpt_oss's reasoning and content (the module's docstring), as the answer streams."""

    def __init__(self, prompt: str | None) -> None:
        self._mode: Literal["", "markers", "stripped", "plain"] = ""  # "": the answer's start is held
        self._start = ""  # the answer's start, while it may still open a message
        self._held = ""  # stripped: the end of the text read, which may be the start of a message
        self._reader: HarmonyReader | None = None
        self._kind: Literal["reasoning", "content", "call"] = "content"  # the message being read
        self._seen = {"reasoning": False, "content": False}  # a message of that kind was read
        if prompt is not None and prompt.endswith(HARMONY_MESSAGE):
            # the prompt opened the message itself (`<|start|>assistant<|channel|>final<|message|>`)
            start = prompt.rfind(HARMONY_START)
            header = parse_header(prompt[max(start, 0) :])
            self._mode, self._reader = "markers", HarmonyReader("body")
            self._open(self._kind_of(header), [], [])

    def read(self, text: str, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        if not self._mode:
            text, self._start = self._start + text, ""
            if not final and not text.startswith(_OPENERS) and any(o.startswith(text) for o in _OPENERS):
                self._start = text  # it may still open a message
                return "", ""
            stripped = next((c for c in _STRIPPED_CHANNELS if text.startswith(c)), None)
            if text.startswith((*HEADER_OPENERS, HARMONY_START)):
                self._mode = "markers"
                self._reader = HarmonyReader("header" if text.startswith(HEADER_OPENERS) else "text")
            elif stripped is not None:
                self._mode = "stripped"
                self._open("reasoning" if stripped == "analysis" else "content", reasoning, content)
                text = text[len(stripped) :]
            else:
                self._mode = "plain"  # no harmony: all of it is the answer
        if self._mode == "plain":
            content.append(text)
        elif self._mode == "stripped":
            self._read_stripped(text, final, reasoning, content)
        else:
            assert self._reader is not None
            for e in self._reader.feed(text, final):
                self._take(e, reasoning, content)
        return "".join(reasoning), "".join(content)

    @staticmethod
    def _kind_of(header: HarmonyHeader) -> Literal["reasoning", "content", "call"]:
        if header.function is not None:
            return "call"
        if header.channel == "analysis" or header.recipient is not None:
            return "reasoning"  # thinking, or a built-in tool's call: not for the user
        return "content"  # final, a commentary preamble, or a channel we do not know

    def _open(self, kind: Literal["reasoning", "content", "call"], reasoning: list[str], content: list[str]) -> None:
        """A message of `kind` starts: messages of one kind are joined by "\\n", as vLLM joins them."""
        self._kind = kind
        if kind != "call":
            if self._seen[kind]:
                (reasoning if kind == "reasoning" else content).append("\n")
            self._seen[kind] = True

    def _take(self, e: HarmonyEvent, reasoning: list[str], content: list[str]) -> None:
        if e.kind == "header":
            assert e.header is not None
            self._open(self._kind_of(e.header), reasoning, content)
            if self._kind == "call":
                content.append(e.header.raw)  # for the tool parser, as written
        elif e.kind == "body":
            (reasoning if self._kind == "reasoning" else content).append(e.text)
        elif e.kind == "end":
            if self._kind == "call":
                content.append(e.text)
            self._kind = "content"
        else:  # text between messages, which harmony has none of: kept, as content
            content.append(e.text)

    def _read_stripped(self, text: str, final: bool, reasoning: list[str], content: list[str]) -> None:
        s, self._held = self._held + text, ""
        i = 0
        while True:
            j, start = _first(s, _STRIPPED_STARTS, i)
            if j < 0:
                hold = 0 if final else max(_partial_suffix(s[i:], m) for m in _STRIPPED_STARTS)
                (reasoning if self._kind == "reasoning" else content).append(s[i : len(s) - hold])
                self._held = s[len(s) - hold :]
                return
            (reasoning if self._kind == "reasoning" else content).append(s[i:j])
            self._open("reasoning" if start.endswith("analysis") else "content", reasoning, content)
            i = j + len(start)
