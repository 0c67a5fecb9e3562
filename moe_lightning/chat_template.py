"""A checkpoint's chat template, rendered the way transformers' `apply_chat_template` renders it.

One module for every process that turns chat messages into a prompt (the gRPC API and the
OpenAI-compatible gateway), so the same conversation always becomes the same token ids, and those
are the ids the model was fine-tuned on: the environment, filters, globals and variables below
mirror `transformers.utils.chat_template_utils` (read there, written anew here).

A template is the checkpoint's code, downloaded with it: beyond the sandbox, a render here can be
bounded in output (`max_bytes`: streamed, and a string or list repeated past the bound is refused
before it is built), and the server renders in processes it can kill (moe_lightning.template_renderer)
for the time and memory a render may take. No error meant for a client names a server path.

Tools and thinking models (docs/openai.md): render() takes the request's `tools` (ToolSpec, passed to
the template as the OpenAI tool objects transformers is given), messages with role `tool` and
assistant messages with `tool_calls` (ToolCall, whose JSON `arguments` are parsed to a value before
rendering, as vLLM does, since templates write them with `tojson`), and `template_kwargs`, extra
template variables such as Qwen3's `enable_thinking` (chat_template_kwargs). The model's answer is
read back by moe_lightning.tool_calls and moe_lightning.reasoning.
"""

from __future__ import annotations

import contextvars
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.runtime
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from moe_lightning.tokenizer import TextTokenizer

ROLES = ("system", "user", "assistant", "tool")
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
# transformers' other templates of a checkpoint (additional_chat_templates/NAME.jinja); `tool_use` is
# the one apply_chat_template renders with when it is given tools
TEMPLATES_DIR = "additional_chat_templates"
TOOL_USE = "tool_use"
# The template variables render() sets itself: template_kwargs may not name them. transformers passes
# apply_chat_template's own arguments (tools, documents, add_generation_prompt) as these variables and
# fails on a `messages` keyword (the conversation is its own argument), so none can come from the
# client's chat_template_kwargs.
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# What render() sets from the checkpoint, and the environment's globals: transformers lets its kwargs
# override the special tokens ({**special_tokens_map, **kwargs}), but a client that sets bos_token or
# eos_token writes the model's own control text where the checkpoint's belongs (issue 54), and one that
# shadows raise_exception or strftime_now changes what the template does, not what it is told
MODEL_VARIABLES = frozenset({"bos_token", "eos_token", "raise_exception", "strftime_now"})
# apply_chat_template's other parameters: transformers takes them for itself, so they never reach a
# template; a client that names one expects what it does there (tokenize, continue a message), which a
# template variable would silently not do
_APPLY_PARAMETERS = frozenset(
    {
        "conversation",
        "chat_template",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
MAX_VALUE_DEPTH = 64  # nesting of a template variable's value (JSON from the client; marshal allows 2000)


# a number a template computes with ** may have at most this many bits (no chat needs more than a few)
MAX_POWER_BITS = 1 << 16
# what the templates cannot do here: the environment has no loader, so they would fail at every render
_LOADS = {
    jinja2.nodes.Include: "include",
    jinja2.nodes.Import: "import",
    jinja2.nodes.FromImport: "from ... import",
    jinja2.nodes.Extends: "extends",
}


class ChatTemplateError(ValueError):
    """A chat request or template that cannot be rendered; the message is meant for the client."""


class RenderLimitError(ChatTemplateError):
    """A render stopped at one of its bounds (output size, a repeated value, a number's size)."""


def _check_str(value: object, what: str, optional: bool = False) -> None:
    if not (isinstance(value, str) or (optional and value is None)):
        raise ChatTemplateError(f"{what} must be a string, got {type(value).__name__}")


# OpenAI's rule for a function's name: a template writes it raw (GPT-OSS's after `functions.`, hermes'
# inside <tool_call>), so an empty one, a newline or `</tool_call>` in it would forge the format
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def check_tool_name(value: object, what: str) -> None:
    """Refuses (ChatTemplateError naming `what`) a function name OpenAI would refuse."""
    _check_str(value, what)
    if not TOOL_NAME.fullmatch(value):  # type: ignore[arg-type]
        shown = repr(value[:64]) + ("..." if len(value) > 64 else "")  # type: ignore[index,arg-type]
        raise ChatTemplateError(f"{what} must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {shown}")


@dataclass(frozen=True)
class ToolCall:
    """One function call of an assistant message, in OpenAI's terms: `arguments` is JSON text, as
    OpenAI sends and returns it (the template is given its value: ChatTemplate.render). `id` is what
    the tool result's `tool_call_id` names; moe_lightning.tool_calls makes them for parsed calls."""

    id: str
    name: str
    arguments: str = "{}"

    def __post_init__(self) -> None:
        _check_str(self.id, "a tool call's id")
        _check_str(self.name, "a tool call's function name")
        _check_str(self.arguments, "a tool call's arguments")

    @classmethod
    def from_openai(cls, call: Mapping[str, Any]) -> ToolCall:
        """`{"id": ..., "type": "function", "function": {"name": ..., "arguments": "<JSON text>"}}`.
        Arguments given as a JSON value rather than its text are taken too (some clients send the
        dict); null arguments are `{}`, as vLLM renders empty ones."""
        if not isinstance(call, Mapping):
            raise ChatTemplateError("a tool call must be an object")
        kind = call.get("type", "function")
        if kind != "function":
            raise ChatTemplateError(f"only function tool calls are supported, got type {kind!r}")
        function = call.get("function")
        if not isinstance(function, Mapping):
            raise ChatTemplateError("a tool call needs a 'function' object")
        arguments = function.get("arguments")
        if arguments is None:
            arguments = "{}"
        elif not isinstance(arguments, str):
            arguments = json.dumps(_plain(arguments, "a tool call's arguments"), ensure_ascii=False)
        check_tool_name(function.get("name"), "a tool call's function name")  # the client's, not a parsed one
        return cls(id=call.get("id"), name=function.get("name"), arguments=arguments)  # type: ignore[arg-type]

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def arguments_value(self) -> Any:
        """The arguments as the template gets them: vLLM parses the JSON text to a value (templates
        write it with `tojson`; given the text, Qwen's would write it as is and others as a quoted
        string), and empty arguments are `{}`."""
        if not self.arguments.strip():
            return {}
        try:
            return json.loads(self.arguments)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ChatTemplateError(
                f"the arguments of tool call {self.id!r} ({self.name}) are not JSON: {exc}"
            ) from None


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call: an OpenAI tool `{"type": "function", "function": {"name",
    "description", "parameters"}}`. `parameters` is the JSON schema of its arguments as JSON text (so
    the spec is immutable and goes over any wire as it is), None where the client gave none."""

    name: str
    description: str | None = None
    parameters: str | None = None

    def __post_init__(self) -> None:
        check_tool_name(self.name, "a tool's function name")
        _check_str(self.description, "a tool's description", optional=True)
        _check_str(self.parameters, "a tool's parameters", optional=True)
        if self.parameters is not None:
            self.parameters_schema()  # refused now, not at the render

    @classmethod
    def from_openai(cls, tool: Mapping[str, Any]) -> ToolSpec:
        if not isinstance(tool, Mapping):
            raise ChatTemplateError("a tool must be an object")
        if tool.get("type", "function") != "function":
            raise ChatTemplateError(f"only function tools are supported, got type {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ChatTemplateError("a tool needs a 'function' object")
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, Mapping):
                raise ChatTemplateError("a tool's parameters must be a JSON schema object")
            parameters = json.dumps(_plain(parameters, "a tool's parameters"), ensure_ascii=False)
        return cls(name=function.get("name"), description=function.get("description"), parameters=parameters)  # type: ignore[arg-type]

    def parameters_schema(self) -> dict[str, Any] | None:
        if self.parameters is None:
            return None
        try:
            schema = json.loads(self.parameters)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ChatTemplateError(f"the parameters of tool {self.name!r} are not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ChatTemplateError(f"the parameters of tool {self.name!r} must be a JSON schema object")
        return schema

    def to_openai(self) -> dict[str, Any]:
        """The tool object as the template gets it: the fields the client gave, in OpenAI's order
        (transformers passes the client's dicts as they are; a field left out stays out, where vLLM's
        model_dump would write it as null)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters_schema()
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ChatMessage:
    """One message of a conversation. `tool_calls` and `reasoning_content` are an assistant's (its
    calls, and the thinking a template may render back, as Qwen3's does after the last user turn);
    `tool_call_id` is a tool result's, naming the call it answers."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ChatTemplateError(
                f"message role {self.role!r} is not supported; the roles allowed are {', '.join(ROLES)}"
            )
        if not isinstance(self.content, str):
            raise ChatTemplateError(f"message content must be a string, got {type(self.content).__name__}")
        if not isinstance(self.tool_calls, tuple) or not all(isinstance(c, ToolCall) for c in self.tool_calls):
            raise ChatTemplateError("a message's tool_calls must be a tuple of ToolCall")
        if self.tool_calls and self.role != "assistant":
            raise ChatTemplateError(f"only an assistant message has tool_calls, not a {self.role} message")
        _check_str(self.tool_call_id, "a message's tool_call_id", optional=True)
        if self.tool_call_id is not None and self.role != "tool":
            raise ChatTemplateError(f"only a tool message has a tool_call_id, not a {self.role} message")
        _check_str(self.reasoning_content, "a message's reasoning_content", optional=True)
        if self.reasoning_content is not None and self.role != "assistant":
            raise ChatTemplateError(f"only an assistant message has reasoning_content, not a {self.role} message")

    @classmethod
    def from_openai(cls, message: Mapping[str, Any]) -> ChatMessage:
        """An OpenAI chat message: `content` may be a string or a list of text parts, and is null in
        an assistant message that only calls tools (rendered as "", as vLLM renders it). `reasoning`
        is vLLM's name for `reasoning_content`."""
        role, content = message.get("role"), message.get("content")
        calls = message.get("tool_calls")
        if content is None and role == "assistant":
            content = ""
        reasoning = message.get("reasoning_content")
        if reasoning is None:
            reasoning = message.get("reasoning")
        return cls(
            role=role,  # type: ignore[arg-type]
            content=content_text(content),  # type: ignore[arg-type]
            tool_calls=tuple(ToolCall.from_openai(c) for c in calls) if isinstance(calls, list) else (),
            tool_call_id=message.get("tool_call_id"),
            reasoning_content=reasoning,
        )

    def template_dict(self) -> dict[str, Any]:
        """The message as the template sees it: transformers' normalised dict (an unset field is left
        out, not None), with its reasoning aliased as transformers aliases it (`thinking` first, for
        gpt-oss templates, and `reasoning_content`), and vLLM's parsed tool call arguments."""
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_value()}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            d = {"thinking": self.reasoning_content, **d, "reasoning_content": self.reasoning_content}
        return d


def content_text(content: str | list[dict[str, Any]]) -> str:
    """OpenAI's content as one string. Text parts are joined with newlines, as vLLM joins them, so a
    client sees the same prompt from either server; any other part (images, audio) is refused, since
    a text model given only the words around an image would answer about a picture it never saw."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatTemplateError("message content must be a string or a list of text parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ChatTemplateError(
                f"only text content parts are supported ({{'type': 'text', 'text': ...}}); got a part of type {kind!r}"
            )
        if not isinstance(part.get("text"), str):
            raise ChatTemplateError("a text content part needs a string 'text' field")
        texts.append(part["text"])
    return "\n".join(texts)


def _plain(value: Any, what: str, depth: int = 0) -> Any:
    """`value` rebuilt of JSON's types (dict with string keys, list, str, int, float, bool, None), as
    transformers rebuilds what a template sees (_plain_template_data), so the sandbox is never handed
    an object with methods of its own; a tuple becomes a list. Refused past MAX_VALUE_DEPTH levels."""
    if depth > MAX_VALUE_DEPTH:
        raise ChatTemplateError(f"{what} is nested more than {MAX_VALUE_DEPTH} levels deep")
    if value is None or type(value) in (str, int, bool):
        return value
    if type(value) is float:
        if not math.isfinite(value):  # json.dumps would write NaN, which is no JSON
            raise ChatTemplateError(f"{what} holds a number that is not finite: {value}")
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ChatTemplateError(f"{what} has a key that is not a string: {k!r}")
            out[str.__str__(k)] = _plain(v, what, depth + 1)
        return out
    if isinstance(value, list | tuple):
        return [_plain(v, what, depth + 1) for v in value]
    raise ChatTemplateError(f"{what} holds a {type(value).__name__}; only JSON values are allowed")


def check_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The client's chat_template_kwargs as template variables: JSON values (copied, _plain), under
    names render() does not set itself (RESERVED_VARIABLES) and that are no apply_chat_template
    parameter. ChatTemplateError (the client's) otherwise. Cheap: the API checks it before a render."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ChatTemplateError("chat_template_kwargs must be an object")
    out = _plain(kwargs, "chat_template_kwargs")
    for name in out:
        if name in RESERVED_VARIABLES:
            raise ChatTemplateError(
                f"chat_template_kwargs may not set {name!r}: the request's own fields set it "
                f"(the template variables {', '.join(sorted(RESERVED_VARIABLES))} are reserved)"
            )
        if name in MODEL_VARIABLES:
            raise ChatTemplateError(
                f"chat_template_kwargs may not set {name!r}: the model's checkpoint sets it "
                f"(the template variables {', '.join(sorted(MODEL_VARIABLES))} are the server's)"
            )
        if name in _APPLY_PARAMETERS:
            raise ChatTemplateError(
                f"chat_template_kwargs may not set {name!r}: it is an apply_chat_template option, not a "
                "template variable, and this server has no such option"
            )
    return out


def _raise_exception(message: str) -> None:
    # transformers raises jinja2's TemplateError; ours lets the API layer tell a refused conversation
    # (the client's error, INVALID_ARGUMENT / HTTP 400) from a bug, in the template's own words
    raise ChatTemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt's text
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant spans with it for its
    training masks; rendering is unchanged, but without the tag such a template would not parse."""

    tags = {"generation"}  # noqa: RUF012 - jinja's Extension API declares it as a class attribute

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


# the bound of the render running in this thread (None: unbounded), read by the intercepted operators
_render_limit: contextvars.ContextVar[int | None] = contextvars.ContextVar("chat_template_limit", default=None)


def _too_large(what: str, size: int, limit: int) -> RenderLimitError:
    return RenderLimitError(
        f"the chat template {what} of {size} characters or items, more than the {limit} bytes a rendered "
        "prompt may have: it cannot render this conversation"
    )


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox transformers relies on, with `*` and `**` checked before they run: one
    `'x' * 10**9` is a single C call that neither streaming nor a time limit can stop in time.
    Intercepted operators are also not folded at compile time (jinja2.nodes.BinExpr.as_const), so a
    constant one cannot run at start-up, outside any bound. Results are those of the plain operators."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        limit = _render_limit.get()
        if limit is not None:
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if isinstance(seq, str | list | tuple) and isinstance(times, int) and len(seq) * times > limit:
                        raise _too_large("repeats a value to one", len(seq) * times, limit)
            elif isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                bits = right * abs(left).bit_length()
                if bits > MAX_POWER_BITS:
                    raise RenderLimitError(
                        f"the chat template computes a number of about {bits} bits; at most {MAX_POWER_BITS} "
                        "are allowed: it cannot render this conversation"
                    )
        return super().call_binop(context, operator, left, right)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    # Templates come from downloaded checkpoints: the immutable sandbox is what transformers relies on
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


def _parse(source: str, origin: str) -> set[str]:
    """Parses (nothing of the template runs: compiling evaluates its constant expressions, filters
    included, so that is left to the first render, or to a renderer process that can be killed):
    a syntax error, or a template that loads others, is refused now, naming `origin`. Returns the
    names the template reads: those of its context among them, and of its own variables (what vLLM
    finds with jinja2.meta, which runs the code generator, and with it constant expressions: not here)."""
    try:
        ast = _environment().parse(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"{origin}: chat template syntax error on line {exc.lineno}: {exc.message}") from exc
    for node in ast.find_all(tuple(_LOADS)):
        raise ChatTemplateError(
            f"{origin}: chat templates may not include, import or extend other templates "
            f"(line {node.lineno}: {{% {_LOADS[type(node)]} %}}); put what it loads in the template itself"
        )
    return {node.name for node in ast.find_all(jinja2.nodes.Name) if node.ctx == "load"}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    def __init__(
        self,
        source: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        origin: str = "chat template",
        tool_source: str | None = None,
    ) -> None:
        """Parses now, so a broken template fails at start-up naming `origin`, not on the first request
        (`origin` is for the server's log and start-up errors: no message sent to a client names it).
        Compiled on first use, or by compile(). `tool_source`: the checkpoint's `tool_use` template,
        which transformers renders with instead whenever it is given tools."""
        self.source, self.bos_token, self.eos_token, self.origin = source, bos_token, eos_token, origin
        self.tool_source = tool_source
        self.variables = _parse(source, origin)  # the names it reads (supports_tools)
        if tool_source is not None:
            self.variables |= _parse(tool_source, f"{origin} ({TOOL_USE})")
        self._template: jinja2.Template | None = None
        self._tool_template: jinja2.Template | None = None

    @property
    def supports_tools(self) -> bool:
        """Whether the template reads `tools` at all: one that does not renders a request's tools as
        nothing, as transformers and vLLM render them (the API may rather refuse such a request)."""
        return "tools" in self.variables

    def compile(self) -> None:
        """Compiles now (a renderer process does, under its limits). A syntax error only the compiler
        finds (a block defined twice) is a ChatTemplateError naming `origin`."""
        if self._template is None:
            self._template = self._compiled(self.source, self.origin)
        if self.tool_source is not None and self._tool_template is None:
            self._tool_template = self._compiled(self.tool_source, f"{self.origin} ({TOOL_USE})")

    @staticmethod
    def _compiled(source: str, origin: str) -> jinja2.Template:
        try:
            return _compile(source)
        except jinja2.TemplateSyntaxError as exc:
            message = f"{origin}: chat template syntax error on line {exc.lineno}: {exc.message}"
            raise ChatTemplateError(message) from exc

    @classmethod
    def from_model_dir(cls, model_dir: Path, override: Path | None = None) -> ChatTemplate | None:
        """The operator's `override` file, else the checkpoint's template, else None (no chat).

        In the checkpoint, a chat_template.jinja file wins over tokenizer_config.json's
        `chat_template`, as in transformers, which writes the file and reads it first."""
        model_dir = Path(model_dir)
        config = _read_tokenizer_config(model_dir / TOKENIZER_CONFIG_FILE)
        tokens = {"bos_token": _token_text(config.get("bos_token")), "eos_token": _token_text(config.get("eos_token"))}
        if override is not None:
            return cls(_read_text(Path(override)), origin=str(override), **tokens)
        template_file = model_dir / TEMPLATE_FILE
        if template_file.is_file():
            # transformers: template files win over the config's entries, its tool_use one included
            tool_file = model_dir / TEMPLATES_DIR / f"{TOOL_USE}.jinja"
            tool_source = _read_text(tool_file) if tool_file.is_file() else None
            return cls(_read_text(template_file), origin=str(template_file), tool_source=tool_source, **tokens)
        value = config.get("chat_template")
        source = _pick_template(value, model_dir / TOKENIZER_CONFIG_FILE)
        if source is None:
            return None
        tool_source = None
        if isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            if TOOL_USE in named and "default" in named:
                tool_source = _checked(named[TOOL_USE], model_dir / TOKENIZER_CONFIG_FILE)
        origin = f"{model_dir / TOKENIZER_CONFIG_FILE}: chat_template"
        return cls(source, origin=origin, tool_source=tool_source, **tokens)

    def render(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        max_bytes: int | None = None,
        *,
        tools: Sequence[ToolSpec] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text, as `apply_chat_template(messages, tools=tools, tokenize=False,
        add_generation_prompt=..., **template_kwargs)` returns it. `tools` None is no tools (the
        template's `tools` is none); an empty sequence is passed as []. `template_kwargs` are the
        client's chat_template_kwargs (check_template_kwargs: JSON values, no reserved name).

        With `max_bytes`, a render whose text passes that many UTF-8 bytes is stopped as soon as it
        does (the output is streamed), and a `*` that would build a longer string or list is refused
        before it runs: RenderLimitError. Time and memory are bounded only in a renderer process."""
        if not messages:
            raise ChatTemplateError("a chat needs at least one message")
        for m in messages:
            if not isinstance(m, ChatMessage):
                raise TypeError(f"messages must be ChatMessage, got {type(m).__name__}")  # the caller's bug
        if tools is not None:
            for t in tools:
                if not isinstance(t, ToolSpec):
                    raise TypeError(f"tools must be ToolSpec, got {type(t).__name__}")
        variables = check_template_kwargs(template_kwargs)
        # transformers passes tools/documents even when None (a template may test `is defined`), and
        # leaves out an unset special token rather than passing None, which would render as "None";
        # its kwargs go after the special tokens, which they may override
        context: dict[str, Any] = {
            "messages": [m.template_dict() for m in messages],
            "tools": None if tools is None else [t.to_openai() for t in tools],
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        for name in ("bos_token", "eos_token"):
            if getattr(self, name) is not None:
                context[name] = getattr(self, name)
        context.update(variables)
        self.compile()
        template = self._tool_template if tools is not None and self._tool_template is not None else self._template
        assert template is not None
        token = _render_limit.set(max_bytes)
        try:
            if max_bytes is None:
                return template.render(**context)
            return _bounded(template.generate(**context), max_bytes)
        except ChatTemplateError:
            raise  # raise_exception's message (the template's own words, as transformers shows it), or a bound
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template cannot render this conversation: {exc}") from exc
        except RecursionError:
            raise ChatTemplateError("the chat template recursed too deeply on this conversation") from None
        except MemoryError:
            raise ChatTemplateError("the chat template ran out of memory on this conversation") from None
        except Exception as exc:  # the template's bug (a TypeError in its expressions): not the server's
            raise ChatTemplateError(
                f"the chat template failed on this conversation: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            _render_limit.reset(token)

    def prompt_ids(
        self,
        tokenizer: TextTokenizer,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        max_bytes: int | None = None,
        *,
        tools: Sequence[ToolSpec] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The rendered chat's token ids, as `apply_chat_template(tokenize=True)` gives them (rendered_ids)."""
        text = self.render(messages, add_generation_prompt, max_bytes, tools=tools, template_kwargs=template_kwargs)
        return rendered_ids(tokenizer, text)


def rendered_ids(tokenizer: TextTokenizer, text: str) -> list[int]:
    """A rendered chat's token ids: tokenized without special tokens, as `apply_chat_template(tokenize=True)`
    does, since the template writes the BOS itself where the model wants one and the tokenizer's own
    would make a second. The one encoding of a chat: the server's (orchestrator.api, on a renderer
    process's text) and prompt_ids', so the tests of prompt_ids against transformers hold for both."""
    return tokenizer.encode(text, add_special_tokens=False)


def _output_too_large(max_bytes: int) -> RenderLimitError:
    return RenderLimitError(
        f"the chat template rendered this conversation to more than {max_bytes} bytes of text, more than any "
        "accepted prompt: send a shorter conversation"
    )


def _bounded(pieces: Any, max_bytes: int) -> str:
    """The streamed render joined, stopped once it passes `max_bytes` (a character is 1 to 4 bytes:
    the text is measured in bytes only where its characters do not decide)."""
    parts, chars = [], 0
    for piece in pieces:
        chars += len(piece)
        if chars > max_bytes:
            raise _output_too_large(max_bytes)
        parts.append(piece)
    text = "".join(parts)
    if 4 * chars > max_bytes and len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        raise _output_too_large(max_bytes)
    return text


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ChatTemplateError(f"{path}: cannot read chat template: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ChatTemplateError(f"{path}: chat template is not UTF-8 text: {exc}") from exc


def _read_tokenizer_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ChatTemplateError(f"{path}: cannot read tokenizer config: {exc}") from exc
    return config if isinstance(config, dict) else {}


def _pick_template(value: Any, where: Path) -> str | None:
    """tokenizer_config.json's `chat_template`: a string, or a list of {"name", "template"}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return _checked(named["default"], where)
        if len(named) == 1:
            return _checked(next(iter(named.values())), where)
        raise ChatTemplateError(
            f"{where}: chat_template lists the templates {sorted(map(str, named))} and none is named 'default'; "
            "choose one with --chat-template FILE"
        )
    raise ChatTemplateError(f"{where}: chat_template must be a string or a list of named templates")


def _checked(template: Any, where: Path) -> str:
    if not isinstance(template, str):
        raise ChatTemplateError(f"{where}: a named chat_template entry has no 'template' string")
    return template
