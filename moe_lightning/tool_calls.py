"""Tool calls in a model's answer: parsed out of its text, whole or as it streams, per call format.

The OpenAI API returns a function call as `tool_calls` (docs/openai.md); a model writes it as text in
the format it was fine-tuned on, which its chat template shows it. One parser per format:

- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call; the closing tag may be missing at the end of the text.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers; a call object may
  carry the `"id"` Mistral's templates write back, which is ignored), and the v11+ form without the
  list, `[TOOL_CALLS]name{...}` or `[TOOL_CALLS]name[ARGS]{...}`, repeated per call, as vLLM's
  mistral parser reads both.
- `llama3_json` (Llama 3.1+): the answer itself, optionally after `<|python_tag|>`, is
  `{"name": ..., "parameters": {...}}` (or `"arguments"`), calls separated by `;`.
- `harmony` (GPT-OSS; vLLM's `openai`): a call is a message of its own to the function,
  `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`
  (the recipient may be in the role's part instead: `<|start|>assistant to=functions.NAME<|channel|>
  commentary json<|message|>`; the first message of an answer has no `<|start|>assistant`, which the
  prompt wrote). It reads the content the `gpt_oss` reasoning parser leaves, in which such messages
  stay as written, or a whole answer; any other message, and any text between them, is content word
  for word. The arguments are the message's body, which must be a JSON object; its `<|call|>` (or
  `<|end|>`, `<|return|>`, or the text's end, where the stop token was left out of the text) ends it.

What is a call, and what stays content, is decided by one state machine for both the whole text
(parse) and the streamed one (StreamingToolParser), so a stream's deltas add up to the parsed answer
however the text is cut. A call's `arguments` are the JSON text the model wrote (checked to be JSON,
never re-serialised, so streamed pieces concatenate to it). A block that turns out not to be a call
before its call was announced (not JSON, no name or no arguments) stays content, word for word. The
text outside the calls is content, less the whitespace around the calls (vLLM drops whitespace-only
content beside calls); with no call it is the text unchanged.

A call can still break after its name was streamed (its JSON goes wrong, or the text ends inside it:
a length cut): a stream cannot take back what it sent, so it ends there (`malformed` is set and the
rest is dropped), while parse() then gives the whole text as content and no call, as vLLM does.

call_grammar gives what a grammar must force for tool_choice "required" or a named function, as the
four strings and schema moe_lightning.grammar's GrammarKind.TOOL_CALLS takes (begin, separator, end,
call schema), such that begin + call + (separator + call)* + end is what the parser reads back.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from moe_lightning.chat_template import ToolCall, ToolSpec
from moe_lightning.config.choices import TOOL_CALL_FORMATS
from moe_lightning.reasoning import (
    FUNCTIONS,
    HARMONY_CALL,
    HARMONY_CHANNEL,
    HARMONY_CONSTRAIN,
    HARMONY_MESSAGE,
    HARMONY_START,
    HarmonyEvent,
    HarmonyReader,
    opens_header,
)

HARMONY = "harmony"
_ALNUM = string.ascii_letters + string.digits


def openai_call_id() -> str:
    """`call_` and 24 random letters and digits, the shape of OpenAI's ids (vLLM's are alike)."""
    return "call_" + "".join(random.choices(_ALNUM, k=24))


def mistral_call_id() -> str:
    """Nine random letters and digits: Mistral's templates refuse any other tool call id when the
    conversation comes back (as vLLM's MistralToolCall makes them)."""
    return "".join(random.choices(_ALNUM, k=9))


# ---- what the parsers give -----------------------------------------------------------------------


@dataclass(frozen=True)
class ContentDelta:
    """Text of the answer outside any call, to stream as `delta.content`."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of the call at `index`, as an OpenAI stream's `delta.tool_calls[]` entry: the first for
    each call has its `id` and `name` (and no arguments), the others the next piece of `arguments`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        if self.name is not None:
            function["name"] = self.name
        function["arguments"] = self.arguments
        out["function"] = function
        return out


Delta = ContentDelta | ToolCallDelta


@dataclass(frozen=True)
class ParsedOutput:
    """An answer read whole: `content` is "" where there is none (the API sends null)."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


# ---- formats ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Format:
    name: str
    marker: str  # what opens a call block in the content ("" for llama3_json: the answer's start)
    argument_keys: frozenset[str]  # the call object's key for the arguments
    new_id: Callable[[], str]
    # whether a call object may have other keys (skipped, as vLLM does: Mistral's templates write an
    # "id"); llama3_json's may not, since its call is the whole answer: an answer that is a JSON
    # object of other keys is content, and streams as such as soon as its first key is read
    other_keys: bool = True


_FORMATS = {
    "hermes": _Format("hermes", "<tool_call>", frozenset({"arguments"}), openai_call_id),
    "mistral": _Format("mistral", "[TOOL_CALLS]", frozenset({"arguments"}), mistral_call_id),
    # Llama's templates ask for "parameters"; vLLM's parser takes "arguments" as well
    "llama3_json": _Format("llama3_json", "", frozenset({"parameters", "arguments"}), openai_call_id, False),
}
# the formats whose calls are JSON objects in the text, read by StreamingToolParser's state machine and
# forced by call_grammar as begin + call (+ separator + call)* + end; harmony's calls are messages of
# their own, each naming its function in its header (HarmonyStreamingParser)
FORMATS = tuple(_FORMATS)
_HERMES_END = "</tool_call>"
_MISTRAL_ARGS = "[ARGS]"
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_JSON_WS = re.compile(r"[ \t\n\r]*")


def detect_format(template_source: str) -> str | None:
    """The call format a chat template teaches, from the markers it writes (None: none known)."""
    if HARMONY_CHANNEL in template_source and HARMONY_CALL in template_source:
        return HARMONY
    if "<tool_call>" in template_source:
        return "hermes"
    if "[TOOL_CALLS]" in template_source:
        return "mistral"
    if "<|python_tag|>" in template_source or (
        "<|start_header_id|>" in template_source and '"parameters": ' in template_source
    ):
        return "llama3_json"
    return None


# ---- JSON, a character at a time -------------------------------------------------------------------

_MORE, _DONE, _ERROR = 0, 1, 2
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_DIGITS = re.compile(r"[0-9]+")
_ESCAPES = frozenset('"\\/bfnrt')
_HEX = frozenset("0123456789abcdefABCDEF")
_NUMBER_END = frozenset({"zero", "int", "frac", "exp"})  # states in which a number may end


class _JsonScanner:
    """Checks one JSON value (RFC 8259, as json.loads takes it but without NaN and Infinity), fed in
    pieces: scan() says whether the value is complete, still open, or wrong, and where. Iterative (no
    recursion), so any nesting the text has is checked in constant stack."""

    def __init__(self) -> None:
        self._stack: list[str] = []  # the open containers: "{" or "["
        self._mode = "value"  # value | string | number | literal | key | key_or_end | colon | after | item_or_end
        self._key = False  # the string being read is an object's key
        self._escape = 0  # in a string: 0, 1 after a backslash, 2..5 hex digits of \\u still to come
        self._number = ""  # the number's state: sign zero int dot frac e esign exp
        self._literal = ""  # what is left of true/false/null

    def scan(self, text: str, i: int) -> tuple[int, int]:
        """Reads text[i:]: (_DONE, j) with text[j] the first character after the value; (_MORE, len)
        when all was read and the value is still open; (_ERROR, j) at the character that breaks it."""
        n = len(text)
        while i < n:
            mode = self._mode
            c = text[i]
            if mode == "string":
                if self._escape == 0:
                    m = _STRING_RUN.match(text, i)
                    if m:
                        i = m.end()
                        continue
                    if c == '"':
                        i += 1
                        if self._key:
                            self._key, self._mode = False, "colon"
                            continue
                        if self._close_value():
                            return _DONE, i
                        continue
                    if c == "\\":
                        self._escape = 1
                        i += 1
                        continue
                    return _ERROR, i  # a control character
                if self._escape == 1:
                    if c == "u":
                        self._escape = 5
                    elif c in _ESCAPES:
                        self._escape = 0
                    else:
                        return _ERROR, i
                    i += 1
                    continue
                if c not in _HEX:
                    return _ERROR, i
                self._escape = 0 if self._escape == 2 else self._escape - 1
                i += 1
                continue
            if mode == "number":
                state = self._number
                if c.isascii() and c.isdigit():
                    if state == "zero":
                        return _ERROR, i
                    if state == "sign" and c == "0":  # "-0" takes no more digits
                        self._number = "zero"
                        i += 1
                        continue
                    m = _DIGITS.match(text, i)
                    assert m is not None
                    i = m.end()
                    self._number = {"sign": "int", "int": "int", "dot": "frac", "frac": "frac"}.get(state, "exp")
                    continue
                if c == "." and state in ("zero", "int"):
                    self._number = "dot"
                elif c in "eE" and state in ("zero", "int", "frac"):
                    self._number = "e"
                elif c in "+-" and state == "e":
                    self._number = "esign"
                elif state in _NUMBER_END:
                    if self._close_value():
                        return _DONE, i  # the number ended before c, which is not the value's
                    continue  # c is read again, after the number
                else:
                    return _ERROR, i
                i += 1
                continue
            if mode == "literal":
                if c != self._literal[0]:
                    return _ERROR, i
                self._literal = self._literal[1:]
                i += 1
                if not self._literal and self._close_value():
                    return _DONE, i
                continue
            if c in " \t\n\r" and (mode != "value" or self._stack):  # a value itself starts where it starts
                i = _JSON_WS.match(text, i).end()  # type: ignore[union-attr]
                continue
            if mode in ("value", "item_or_end"):
                if mode == "item_or_end" and c == "]":
                    self._stack.pop()
                    i += 1
                    if self._close_value():
                        return _DONE, i
                    continue
                i += 1
                if c == '"':
                    self._mode = "string"
                elif c == "{":
                    self._stack.append("{")
                    self._mode = "key_or_end"
                elif c == "[":
                    self._stack.append("[")
                    self._mode = "item_or_end"
                elif c == "-":
                    self._mode, self._number = "number", "sign"
                elif c.isascii() and c.isdigit():
                    self._mode, self._number = "number", "zero" if c == "0" else "int"
                elif c in "tfn":
                    self._mode, self._literal = "literal", {"t": "rue", "f": "alse", "n": "ull"}[c]
                else:
                    return _ERROR, i - 1
                continue
            if mode in ("key", "key_or_end"):
                if c == '"':
                    self._mode, self._key = "string", True
                elif c == "}" and mode == "key_or_end":
                    self._stack.pop()
                    i += 1
                    if self._close_value():
                        return _DONE, i
                    continue
                else:
                    return _ERROR, i
                i += 1
                continue
            if mode == "colon":
                if c != ":":
                    return _ERROR, i
                self._mode = "value"
                i += 1
                continue
            # after a value in a container
            top = self._stack[-1]
            if c == ",":
                self._mode = "key" if top == "{" else "value"
            elif c == ("}" if top == "{" else "]"):
                self._stack.pop()
                i += 1
                if self._close_value():
                    return _DONE, i
                continue
            else:
                return _ERROR, i
            i += 1
        return _MORE, n

    def ends_here(self) -> bool:
        """At the end of the text: whether the value is complete there (a number has no end mark)."""
        return self._mode == "number" and not self._stack and self._number in _NUMBER_END

    def _close_value(self) -> bool:
        """A value ended: True when it was the whole one, else the container it is in goes on."""
        if not self._stack:
            self._mode = "done"
            return True
        self._mode = "after"
        return False


# ---- the state machine -----------------------------------------------------------------------------


class _Call:
    """The call object being read: `{"name": ..., "arguments": ...}` in any key order, other keys
    skipped. Its call is announced (committed) once its name is known and its arguments begun. The
    positions are absolute offsets in the answer."""

    def __init__(self) -> None:
        self.phase = "open"  # open key_or_end key colon value in_value after
        self.kind = ""  # what the token being read is: key | name | args | skip
        self.key = ""
        self.token_start = -1  # where the key or value being read starts
        self.name: str | None = None
        self.args_start = -1  # where the arguments' value starts (-1: not yet)
        self.args_end = -1  # where it ends, once complete
        self.sent = -1  # how far its text was streamed
        self.index: int | None = None  # its place among the answer's calls, once committed
        self.scanner = _JsonScanner()


class StreamingToolParser:
    """Reads a model's answer as it streams: feed() each piece of text, finish() at its end; each
    returns the deltas that piece decided (ContentDelta, ToolCallDelta), in order. Text that may be
    the start of a call is held back until it is known to be one or not. `StreamingToolParser("harmony")`
    is a HarmonyStreamingParser, so that one type streams every format."""

    def __new__(cls, format: str, *, new_id: Callable[[], str] | None = None) -> StreamingToolParser:
        if cls is StreamingToolParser and format == HARMONY:
            return super().__new__(HarmonyStreamingParser)
        return super().__new__(cls)

    def __init__(self, format: str, *, new_id: Callable[[], str] | None = None) -> None:
        if format not in _FORMATS:
            raise ValueError(f"unknown tool call format {format!r}; known: {', '.join(TOOL_CALL_FORMATS)}")
        self._fmt = _FORMATS[format]
        self._new_id = new_id or self._fmt.new_id
        self._buf = ""  # the answer from absolute offset _base on
        self._base = 0
        self._pos = 0  # absolute: the next character to read
        self._state = "start" if self._fmt.marker == "" else "content"
        self._out: list[Delta] = []
        self._text_parts: list[str] = []  # the content delta being gathered
        self._args_parts: list[str] = []  # the arguments delta being gathered, of call _args_index
        self._args_index = -1
        self._ws: list[str] = []  # content whitespace held back: it is dropped if a call comes next
        self._after_call = False  # the content's whitespace right after a call is dropped
        self._calls = 0
        self._call: _Call | None = None
        self._hold = -1  # absolute start of the text held back while it may be a call (-1: none)
        self._in_list = False  # mistral: inside [TOOL_CALLS][...]
        self._name_start = self._name_end = -1  # mistral v11: the name before the arguments
        self._finished = False
        self.malformed = False  # a call broke after it was announced (see the module's docstring)

    @property
    def calls(self) -> int:
        """How many calls were announced so far."""
        return self._calls

    def feed(self, text: str) -> list[Delta]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if text and self._state != "dead":
            self._buf += text
            self._advance(final=False)
            self._compact()
        return self._take()

    def finish(self) -> list[Delta]:
        """The end of the answer: what was held back is decided (a partial marker is content, a call
        cut short breaks), and trailing content whitespace is dropped if there were calls."""
        if not self._finished:
            self._finished = True
            if self._state != "dead":
                self._advance(final=True)
            if self._calls == 0:
                self._emit_text("".join(self._ws))
            self._ws = []
        return self._take()

    # ---- output --------------------------------------------------------------------------------
    # Pieces of one delta are gathered in lists and joined once (a long answer read in one feed, or a
    # long run of whitespace, would otherwise be copied over and over)
    def _take(self) -> list[Delta]:
        self._flush()
        out, self._out = self._out, []
        return out

    def _flush(self) -> None:
        if self._text_parts:
            self._out.append(ContentDelta("".join(self._text_parts)))
            self._text_parts = []
        if self._args_parts:
            self._out.append(ToolCallDelta(self._args_index, arguments="".join(self._args_parts)))
            self._args_parts = []

    def _emit_text(self, text: str) -> None:
        if not text:
            return
        if self._args_parts:
            self._flush()
        self._text_parts.append(text)

    def _emit_call(self, index: int, id: str, name: str) -> None:
        self._flush()
        self._out.append(ToolCallDelta(index, id, name))

    def _emit_args(self, index: int, text: str) -> None:
        if self._text_parts or (self._args_parts and self._args_index != index):
            self._flush()
        self._args_index = index
        self._args_parts.append(text)

    def _content(self, text: str) -> None:
        """Content text, its trailing whitespace held back (dropped if a call follows it), and the
        whitespace right after a call dropped."""
        if not text:
            return
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if body:
            self._emit_text("".join(self._ws))
            self._emit_text(body)
            self._ws = []
        if len(body) < len(text):
            self._ws.append(text[len(body) :])

    # ---- the buffer ----------------------------------------------------------------------------
    def _text(self, start: int, end: int) -> str:
        return self._buf[start - self._base : end - self._base]

    def _rel(self) -> tuple[str, int]:
        """The buffer, and the read position in it."""
        return self._buf, self._pos - self._base

    def _compact(self) -> None:
        """Drops the text nothing refers to any more, so a long answer is not kept whole."""
        keep = [self._pos]
        if self._hold >= 0:
            keep.append(self._hold)
        if self._name_start >= 0:
            keep.append(self._name_start)
        call = self._call
        if call is not None:
            keep += [p for p in (call.token_start, call.sent) if p >= 0]
            if call.index is None and call.args_start >= 0:
                keep.append(call.args_start)
        cut = min(keep)
        if cut > self._base:
            self._buf = self._buf[cut - self._base :]
            self._base = cut

    def _waits_for(self, word: str, final: bool) -> bool | None:
        """At the read position: True if `word` is there, None if what is there so far may still
        become it (wait for more), False if not."""
        buf, i = self._rel()
        rest = buf[i : i + len(word)]
        if rest == word:
            return True
        if not final and word.startswith(rest):
            return None
        return False

    # ---- the machine ---------------------------------------------------------------------------
    # Each state reads from _pos; it returns True when it changed state (the next one reads on), or
    # False when it needs more text (or, `final`, when all is read).
    def _advance(self, final: bool) -> None:
        while getattr(self, "_s_" + self._state)(final):
            pass

    def _after_block(self) -> str:
        return "content" if self._fmt.marker else "plain"

    def _fail(self) -> bool:
        """What was held back is no call after all: it is content up to the read position, and
        reading goes on from there, as content."""
        assert self._hold >= 0
        self._content(self._text(self._hold, self._pos))
        self._hold, self._call, self._in_list = -1, None, False
        self._name_start = self._name_end = -1
        self._state = self._after_block()
        return True

    def _break(self) -> bool:
        """A call announced already went wrong: nothing right can be told of the rest."""
        self.malformed = True
        self._state = "dead"
        self._hold, self._call = -1, None
        self._buf, self._base = "", self._pos
        return True

    def _wrong(self, call: _Call) -> bool:
        """The call object is wrong at the read position: content if its call was not announced."""
        return self._fail() if call.index is None else self._break()

    def _s_dead(self, final: bool) -> bool:
        return False

    def _s_plain(self, final: bool) -> bool:
        """llama3_json's answer that did not open with a call: all of it is content."""
        buf, i = self._rel()
        self._content(buf[i:])
        self._pos = self._base + len(buf)
        return False

    def _s_start(self, final: bool) -> bool:
        """llama3_json: a call opens the answer (after whitespace, perhaps after <|python_tag|>)."""
        buf, i = self._rel()
        j = len(buf) - len(buf[i:].lstrip())
        self._content(buf[i:j])
        self._pos = self._base + j
        if j == len(buf):
            if final:
                self._state = "plain"
                return True
            return False
        tag = self._waits_for(_PYTHON_TAG, final)
        if tag is None:
            return False
        self._hold = self._pos
        if tag:
            self._pos += len(_PYTHON_TAG)
        self._call = _Call()
        self._state = "object"
        return True

    def _s_content(self, final: bool) -> bool:
        marker = self._fmt.marker
        buf, i = self._rel()
        while True:
            j = buf.find(marker[0], i)
            if j < 0:
                self._content(buf[i:])
                self._pos = self._base + len(buf)
                return False
            self._content(buf[i:j])
            self._pos = self._base + j
            found = self._waits_for(marker, final)
            if found is None:
                return False  # held back: it may be the marker
            if found:
                self._hold = self._pos
                self._pos += len(marker)
                self._state = "block"
                return True
            self._content(buf[j])
            i = j + 1
            self._pos = self._base + i

    def _skip_ws(self) -> tuple[str, int]:
        buf, i = self._rel()
        m = _JSON_WS.match(buf, i)
        assert m is not None
        self._pos = self._base + m.end()
        return buf, m.end()

    def _s_block(self, final: bool) -> bool:
        """Right after the marker: hermes' call object; mistral's list of them, or a name."""
        buf, j = self._skip_ws()
        if j == len(buf):
            return self._fail() if final else False
        self._call = _Call()
        if self._fmt.name == "mistral":
            if buf[j] != "[":
                self._name_start = self._pos
                self._state = "name"
                return True
            self._pos += 1
            self._in_list = True
        self._state = "object"
        return True

    def _s_name(self, final: bool) -> bool:
        """mistral's v11 form, [TOOL_CALLS]name{...} or [TOOL_CALLS]name[ARGS]{...}: the name."""
        buf, i = self._rel()
        m = _MISTRAL_NAME.match(buf, i)
        if m:
            i = m.end()
            self._pos = self._base + i
        if i == len(buf):
            return self._fail() if final else False
        self._name_end = self._pos
        if buf[i] == "[":
            found = self._waits_for(_MISTRAL_ARGS, final)
            if found is None:
                return False
            if not found:
                return self._fail()
            self._pos += len(_MISTRAL_ARGS)
        self._state = "name_args"
        return True

    def _s_name_args(self, final: bool) -> bool:
        buf, i = self._rel()
        if i == len(buf):
            return self._fail() if final else False
        call = self._call
        assert call is not None
        if buf[i] != "{" or self._name_end <= self._name_start:
            return self._fail()
        call.name = self._text(self._name_start, self._name_end)
        self._name_start = self._name_end = -1
        call.phase, call.kind, call.token_start = "in_value", "args", self._pos
        call.args_start = call.sent = self._pos
        self._commit(call)
        self._state = "arguments"
        return True

    def _s_arguments(self, final: bool) -> bool:
        """The arguments of a v11 mistral call, whose end is the call's."""
        call = self._call
        assert call is not None
        buf, i = self._rel()
        status, j = call.scanner.scan(buf, i)
        if status == _MORE and final and call.scanner.ends_here():
            status = _DONE
        self._pos = self._base + j
        self._stream_args(call)
        if status == _ERROR or (status == _MORE and final):
            return self._break()
        if status == _MORE:
            return False
        self._end_call()
        self._state = "content"
        return True

    def _s_object(self, final: bool) -> bool:
        call = self._call
        assert call is not None
        while True:
            if call.phase == "in_value":
                buf, i = self._rel()
                status, j = call.scanner.scan(buf, i)
                if status == _MORE and final and call.scanner.ends_here():
                    status, j = _DONE, len(buf)
                self._pos = self._base + j
                if call.kind == "args" and call.index is not None:
                    self._stream_args(call)
                if status == _ERROR or (status == _MORE and final):
                    return self._wrong(call)
                if status == _MORE:
                    return False
                if not self._token_done(call):
                    return True  # the block failed or the call broke: the state changed
                continue
            buf, j = self._skip_ws()
            if j == len(buf):
                return self._wrong(call) if final else False
            c, phase = buf[j], call.phase
            if phase == "open":
                if c != "{":
                    return self._fail()
                call.phase = "key_or_end"
            elif phase in ("key_or_end", "key"):
                if c == "}" and phase == "key_or_end":
                    self._pos += 1
                    return self._object_done(call)
                if c != '"':
                    return self._wrong(call)
                call.phase, call.kind, call.token_start = "in_value", "key", self._pos
                call.scanner = _JsonScanner()
                continue
            elif phase == "colon":
                if c != ":":
                    return self._wrong(call)
                call.phase = "value"
            elif phase == "value":
                self._value_start(call)
                continue
            elif c == ",":  # after a value
                call.phase = "key"
            elif c == "}":
                self._pos += 1
                return self._object_done(call)
            else:
                return self._wrong(call)
            self._pos += 1

    def _value_start(self, call: _Call) -> None:
        call.phase, call.token_start, call.scanner = "in_value", self._pos, _JsonScanner()
        if call.key == "name":
            call.kind = "name"
        elif call.key in self._fmt.argument_keys:
            call.kind = "args"
            call.args_start = call.sent = self._pos
            if call.name is not None:
                self._commit(call)
        else:
            call.kind = "skip"

    def _token_done(self, call: _Call) -> bool:
        """A key or value of the call object was read (it ends at the read position). False when
        that made the block fail or the call break."""
        raw = self._text(call.token_start, self._pos)
        call.token_start = -1
        if call.kind == "key":
            key = json.loads(raw)
            known = key == "name" or key in self._fmt.argument_keys
            twice = (key == "name" and call.name is not None) or (
                key in self._fmt.argument_keys and call.args_start >= 0
            )
            if twice or not (known or self._fmt.other_keys):
                self._wrong(call)
                return False
            call.key, call.phase = key, "colon"
            return True
        call.phase = "after"
        if call.kind == "name":
            name = json.loads(raw) if raw.startswith('"') else None
            if not isinstance(name, str) or not name:
                self._wrong(call)
                return False
            call.name = name
            if call.args_start >= 0:
                self._commit(call)
        elif call.kind == "args":
            call.args_end = self._pos
            if call.index is not None:
                self._stream_args(call)
        return True

    def _commit(self, call: _Call) -> None:
        """The block is a call: announce it, with what was read of its arguments."""
        assert call.name is not None
        call.index = self._calls
        self._calls += 1
        self._ws = []  # the whitespace before a call is no content
        self._after_call = False
        self._hold = -1
        self._emit_call(call.index, self._new_id(), call.name)
        self._stream_args(call)

    def _stream_args(self, call: _Call) -> None:
        assert call.index is not None and call.args_start >= 0
        end = call.args_end if call.args_end >= 0 else self._pos
        if end > call.sent:
            self._emit_args(call.index, self._text(call.sent, end))
            call.sent = end

    def _object_done(self, call: _Call) -> bool:
        if call.index is None:  # no name, or no arguments: the block is content, its "}" too
            return self._fail()
        self._end_call()
        self._state = "after"
        return True

    def _end_call(self) -> None:
        self._call = None
        self._after_call = True

    def _s_after(self, final: bool) -> bool:
        """After a call object: hermes' closing tag, mistral's list going on, llama3_json's `;`."""
        # the whitespace after a call is no content: read on past it (while a separator may follow)
        buf, j = self._skip_ws()
        if j == len(buf):
            if final:
                self._state = self._after_block()
                return True
            return False
        fmt = self._fmt.name
        if fmt == "hermes":
            found = self._waits_for(_HERMES_END, final)
            if found is None:
                return False
            if found:
                self._pos += len(_HERMES_END)
            self._state = "content"  # without its closing tag, the block ends with its object
            return True
        separator = ";" if fmt == "llama3_json" else ","
        if buf[j] == separator and (fmt == "llama3_json" or self._in_list):
            self._hold = self._pos  # the separator and what follows are held, as a block is
            self._pos += 1
            self._call = _Call()
            self._state = "object"
            return True
        if self._in_list and buf[j] == "]":
            self._pos += 1
        self._in_list = False
        self._state = self._after_block()
        return True


# ---- harmony -----------------------------------------------------------------------------------------


class _HarmonyCall:
    """The call message being read: its index, and where its arguments' JSON is."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.phase = "before"  # before (whitespace, then "{") | json | after (whitespace only)
        self.scanner = _JsonScanner()


class HarmonyStreamingParser(StreamingToolParser):
    """GPT-OSS's calls (the module's docstring), as the answer streams: a call is announced once its
    header is read (its name is in it), and its arguments stream as its body comes. A message to a
    function whose body is no JSON object, or that the text's end cuts short, breaks the stream
    (`malformed`), as a broken call of the other formats does. It shares only the output's gathering
    with the other formats' machine."""

    def __init__(self, format: str = HARMONY, *, new_id: Callable[[], str] | None = None) -> None:
        if format != HARMONY:
            raise ValueError(f"HarmonyStreamingParser reads the {HARMONY} format, not {format!r}")
        self._new_id = new_id or openai_call_id
        self._out: list[Delta] = []
        self._text_parts: list[str] = []
        self._args_parts: list[str] = []
        self._args_index = -1
        self._start = ""  # the answer's start, held while it may open a header (no <|start|> before it)
        self._reader: HarmonyReader | None = None
        self._call: _HarmonyCall | None = None
        self._calls = 0
        self._finished = False
        self._dead = False
        self.malformed = False

    def feed(self, text: str) -> list[Delta]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if text and not self._dead:
            self._read(text, final=False)
        return self._take()

    def finish(self) -> list[Delta]:
        if not self._finished:
            self._finished = True
            if not self._dead:
                self._read("", final=True)
        return self._take()

    def _read(self, text: str, final: bool) -> None:
        if self._reader is None:
            text, self._start = self._start + text, ""
            opens = opens_header(text, final)
            if opens is None:
                self._start = text
                return
            self._reader = HarmonyReader("header" if opens else "text")
        for event in self._reader.feed(text, final):
            self._event(event)
            if self._dead:
                self._reader = None
                return

    def _event(self, e: HarmonyEvent) -> None:
        call = self._call
        if e.kind == "header":
            assert e.header is not None
            name = e.header.function
            if name is None:
                self._emit_text(e.header.raw)  # no call: the message is content, as written
                return
            self._call = _HarmonyCall(self._calls)
            self._calls += 1
            self._emit_call(self._call.index, self._new_id(), name)
        elif e.kind == "body" and call is not None:
            self._arguments(call, e.text)
        elif e.kind == "end" and call is not None:
            if call.phase != "after":  # its JSON is not complete: cut short, or no JSON at all
                self._break()
                return
            self._call = None  # its terminator is no content
        else:  # text between messages, a message that is no call, its end
            self._emit_text(e.text)

    def _arguments(self, call: _HarmonyCall, text: str) -> None:
        i = 0
        while i < len(text) and not self._dead:
            if call.phase == "before":
                i = _JSON_WS.match(text, i).end()  # type: ignore[union-attr]
                if i == len(text):
                    return
                if text[i] != "{":  # OpenAI's arguments are an object
                    self._break()
                    return
                call.phase = "json"
            elif call.phase == "json":
                status, j = call.scanner.scan(text, i)
                self._emit_args(call.index, text[i:j])  # up to where it broke, however the text was cut
                if status == _ERROR:
                    self._break()
                    return
                i = j
                if status == _DONE:
                    call.phase = "after"
            else:  # only whitespace may follow the object in its message
                if _JSON_WS.match(text, i).end() != len(text):  # type: ignore[union-attr]
                    self._break()
                return

    def _break(self) -> None:
        self.malformed = self._dead = True
        self._call = None


def _harmony_header(name: str, first: bool) -> str:
    """The header of a call of `name`, as GPT-OSS writes it; the answer's first message has no
    `<|start|>assistant` (the prompt ends with it)."""
    start = "" if first else HARMONY_START + "assistant"
    return f"{start}{HARMONY_CHANNEL}commentary to={FUNCTIONS}{name} {HARMONY_CONSTRAIN}json{HARMONY_MESSAGE}"


# ---- whole answers -----------------------------------------------------------------------------------


class ToolParser:
    """A format's parser: parse() for an answer read whole, stream() for one read as it comes."""

    def __init__(self, format: str, *, new_id: Callable[[], str] | None = None) -> None:
        if format not in TOOL_CALL_FORMATS:
            raise ValueError(f"unknown tool call format {format!r}; known: {', '.join(TOOL_CALL_FORMATS)}")
        self.format = format
        self._new_id = new_id

    def stream(self) -> StreamingToolParser:
        return StreamingToolParser(self.format, new_id=self._new_id)

    def parse(self, text: str) -> ParsedOutput:
        """The calls in `text` and the content around them; a call that broke after its start (bad
        JSON, or cut short) makes it all content, as vLLM gives it."""
        s = self.stream()
        deltas = s.feed(text) + s.finish()
        if s.malformed:
            return ParsedOutput(content=text)
        return assemble(deltas)


def parser_for(format: str, *, new_id: Callable[[], str] | None = None) -> ToolParser:
    """The parser of `format` (TOOL_CALL_FORMATS; detect_format reads it from a template). `new_id` makes the
    calls' ids (default: the format's, openai_call_id or mistral_call_id)."""
    return ToolParser(format, new_id=new_id)


def assemble(deltas: Sequence[Delta]) -> ParsedOutput:
    """A stream's deltas as the whole answer they add up to."""
    content: list[str] = []
    calls: list[list[str]] = []  # id, name, arguments
    for d in deltas:
        if isinstance(d, ContentDelta):
            content.append(d.text)
        elif d.id is not None:
            assert d.index == len(calls), "a call's first delta names it"
            calls.append([d.id, d.name or "", d.arguments])
        else:
            calls[d.index][2] += d.arguments
    return ParsedOutput("".join(content), [ToolCall(i, n, a) for i, n, a in calls])


def render_calls(format: str, calls: Sequence[ToolCall]) -> str:
    """`calls` written as the format writes them (what call_grammar forces), e.g. to test a parser,
    or to show a model its earlier calls where no template does. harmony's: one message per call."""
    if format == HARMONY:
        return "".join(_harmony_header(c.name, i == 0) + c.arguments + HARMONY_CALL for i, c in enumerate(calls))
    begin, separator, end = _PIECES[format]
    objects = [_call_object(format, c) for c in calls]
    return begin + separator.join(objects) + end


# ---- grammars ------------------------------------------------------------------------------------

# what each format writes around its calls, as the parser reads it back
_PIECES = {
    "hermes": ("<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>"),
    "mistral": ("[TOOL_CALLS][", ", ", "]"),
    "llama3_json": ("", "; ", ""),
}


def _arguments_key(format: str) -> str:
    return "parameters" if format == "llama3_json" else "arguments"


def _call_object(format: str, call: ToolCall) -> str:
    return (
        '{"name": '
        + json.dumps(call.name, ensure_ascii=False)
        + f', "{_arguments_key(format)}": '
        + call.arguments
        + "}"
    )


class CallGrammar(NamedTuple):
    """What a grammar must force: `begin`, one call object matching `schema`, then (`separator`, a
    call)* unless `separator` is None (exactly one call), then `end`. source() is its GrammarKind
    TOOL_CALLS source."""

    begin: str
    separator: str | None
    end: str
    schema: dict[str, Any]

    def source(self) -> str:
        return json.dumps(
            {"begin": self.begin, "separator": self.separator, "end": self.end, "schema": self.schema},
            ensure_ascii=False,
        )


# a function given without parameters takes none: its arguments are the empty object
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def _parameters(tool: ToolSpec) -> dict[str, Any]:
    parameters = tool.parameters_schema()
    if parameters is None:
        return _NO_PARAMETERS
    if not parameters:
        return {"type": "object"}  # `{}` constrains nothing, but arguments are an object still
    return parameters


def _call_schema(format: str, tool: ToolSpec) -> dict[str, Any]:
    parameters = _parameters(tool)
    key = _arguments_key(format)
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, key: parameters},
        "required": ["name", key],
        "additionalProperties": False,
    }


def call_grammar(
    format: str, tools: Sequence[ToolSpec], tool_choice: str | Mapping[str, Any], parallel: bool = True
) -> CallGrammar:
    """For tool_choice "required": one or more calls of any of `tools` (one only unless `parallel`,
    the request's parallel_tool_calls); for a named function (OpenAI's `{"type": "function",
    "function": {"name": ...}}`): exactly one call of it. ValueError for a choice that forces nothing
    ("auto", "none"), a name not among `tools`, or no tools.

    harmony names the function in the call's header, outside the JSON a grammar forces: the header of
    the one function is `begin` and its arguments are the call, so only a named function, or
    "required" with one tool, can be forced (ValueError for several). One call either way: GPT-OSS
    stops at each call's <|call|>."""
    if format not in TOOL_CALL_FORMATS:
        raise ValueError(f"unknown tool call format {format!r}; known: {', '.join(TOOL_CALL_FORMATS)}")
    if not tools:
        raise ValueError("tool_choice needs tools to choose from")
    if format == HARMONY:
        return _harmony_grammar(tools, tool_choice)
    begin, separator, end = _PIECES[format]
    if tool_choice == "required":
        schemas = [_call_schema(format, t) for t in tools]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        return CallGrammar(begin, separator if parallel else None, end, schema)
    if isinstance(tool_choice, Mapping):
        return CallGrammar(begin, None, end, _call_schema(format, _named(tool_choice, tools)))
    raise ValueError(f"tool_choice {tool_choice!r} forces no call: only 'required' or a named function does")


def _named(tool_choice: Mapping[str, Any], tools: Sequence[ToolSpec]) -> ToolSpec:
    """The tool a named tool_choice names."""
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError('a named tool_choice is {"type": "function", "function": {"name": ...}}')
    for t in tools:
        if t.name == name:
            return t
    raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")


def _harmony_grammar(tools: Sequence[ToolSpec], tool_choice: str | Mapping[str, Any]) -> CallGrammar:
    if tool_choice == "required":
        if len(tools) > 1:
            raise ValueError(
                "tool_choice required cannot be forced with several tools for this model: its calls (harmony) "
                "name the function outside the arguments a grammar constrains; name one function instead"
            )
        tool = tools[0]
    elif isinstance(tool_choice, Mapping):
        tool = _named(tool_choice, tools)
    else:
        raise ValueError(f"tool_choice {tool_choice!r} forces no call: only 'required' or a named function does")
    # the answer starts right after the prompt's <|start|>assistant; the generation ends at the
    # object, with the model's stop token (<|call|>, left out of the text as a stop token is)
    return CallGrammar(_harmony_header(tool.name, True), None, "", _parameters(tool))
