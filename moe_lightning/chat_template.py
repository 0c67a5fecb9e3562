"""A checkpoint's chat template, rendered the way transformers' `apply_chat_template` renders it.

One module for every process that turns chat messages into a prompt (the gRPC API and the
OpenAI-compatible gateway), so the same conversation always becomes the same token ids, and those
are the ids the model was fine-tuned on: the environment, filters, globals and variables below
mirror `transformers.utils.chat_template_utils` (read there, written anew here).

A template is the checkpoint's code, downloaded with it: beyond the sandbox, a render here can be
bounded in output (`max_bytes`: streamed, and a string or list repeated past the bound is refused
before it is built), and the server renders in processes it can kill (moe_lightning.template_renderer)
for the time and memory a render may take. No error meant for a client names a server path.
"""

from __future__ import annotations

import contextvars
import json
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

ROLES = ("system", "user", "assistant")
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


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


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ChatTemplateError(
                f"message role {self.role!r} is not supported; the roles allowed are {', '.join(ROLES)}"
            )
        if not isinstance(self.content, str):
            raise ChatTemplateError(f"message content must be a string, got {type(self.content).__name__}")

    @classmethod
    def from_openai(cls, message: Mapping[str, Any]) -> ChatMessage:
        """An OpenAI chat message: `content` may be a string or a list of text parts."""
        return cls(role=message.get("role"), content=content_text(message.get("content")))  # type: ignore[arg-type]


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


def _parse(source: str, origin: str) -> None:
    """Parses (nothing of the template runs: compiling evaluates its constant expressions, filters
    included, so that is left to the first render, or to a renderer process that can be killed):
    a syntax error, or a template that loads others, is refused now, naming `origin`."""
    try:
        ast = _environment().parse(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"{origin}: chat template syntax error on line {exc.lineno}: {exc.message}") from exc
    for node in ast.find_all(tuple(_LOADS)):
        raise ChatTemplateError(
            f"{origin}: chat templates may not include, import or extend other templates "
            f"(line {node.lineno}: {{% {_LOADS[type(node)]} %}}); put what it loads in the template itself"
        )


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    def __init__(
        self, source: str, bos_token: str | None = None, eos_token: str | None = None, origin: str = "chat template"
    ) -> None:
        """Parses now, so a broken template fails at start-up naming `origin`, not on the first request
        (`origin` is for the server's log and start-up errors: no message sent to a client names it).
        Compiled on first use, or by compile()."""
        self.source, self.bos_token, self.eos_token, self.origin = source, bos_token, eos_token, origin
        _parse(source, origin)
        self._template: jinja2.Template | None = None

    def compile(self) -> None:
        """Compiles now (a renderer process does, under its limits). A syntax error only the compiler
        finds (a block defined twice) is a ChatTemplateError naming `origin`."""
        if self._template is None:
            try:
                self._template = _compile(self.source)
            except jinja2.TemplateSyntaxError as exc:
                raise ChatTemplateError(
                    f"{self.origin}: chat template syntax error on line {exc.lineno}: {exc.message}"
                ) from exc

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
            return cls(_read_text(template_file), origin=str(template_file), **tokens)
        source = _pick_template(config.get("chat_template"), model_dir / TOKENIZER_CONFIG_FILE)
        if source is None:
            return None
        return cls(source, origin=f"{model_dir / TOKENIZER_CONFIG_FILE}: chat_template", **tokens)

    def render(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, max_bytes: int | None = None
    ) -> str:
        """The prompt text, as `apply_chat_template(messages, tokenize=False)` returns it.

        With `max_bytes`, a render whose text passes that many UTF-8 bytes is stopped as soon as it
        does (the output is streamed), and a `*` that would build a longer string or list is refused
        before it runs: RenderLimitError. Time and memory are bounded only in a renderer process."""
        if not messages:
            raise ChatTemplateError("a chat needs at least one message")
        for m in messages:
            if not isinstance(m, ChatMessage):
                raise TypeError(f"messages must be ChatMessage, got {type(m).__name__}")  # the caller's bug
        # transformers passes tools/documents even when None (a template may test `is defined`), and
        # leaves out an unset special token rather than passing None, which would render as "None"
        context: dict[str, Any] = {
            "messages": [{"role": m.role, "content": m.content} for m in messages],
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        for name in ("bos_token", "eos_token"):
            if getattr(self, name) is not None:
                context[name] = getattr(self, name)
        self.compile()
        assert self._template is not None
        token = _render_limit.set(max_bytes)
        try:
            if max_bytes is None:
                return self._template.render(**context)
            return _bounded(self._template.generate(**context), max_bytes)
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
    ) -> list[int]:
        """The rendered chat's token ids, as `apply_chat_template(tokenize=True)` gives them (rendered_ids)."""
        return rendered_ids(tokenizer, self.render(messages, add_generation_prompt, max_bytes))


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
