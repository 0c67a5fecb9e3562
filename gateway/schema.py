"""The OpenAI request bodies we take, as pydantic models (FastAPI validates with them), and what
each becomes: one GenerationInput per choice. Fields we cannot honour are refused with the field
named, never silently ignored; fields that change nothing here (user, ...) are accepted.

Every value that passes validation fits its protobuf field (the bounds below are the proto's types),
and every string is valid Unicode (a lone surrogate cannot be encoded as UTF-8, so protobuf, and the
JSON error that echoed it, would fail): no body reaches an exception that is not a 400 naming its
field. The same models read the OpenAI Batch files of `moe-lightning run` (commands/openai_batch.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SkipValidation, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from moe_lightning.api.generation.v1 import generation_pb2
from moe_lightning.request import InvalidRequestError
from moe_lightning.validation import CONTEXT_BOUND, MAX_BATCH_PROMPTS, check_conversation_size, check_text_size

MAX_CHOICES = 16  # n: each choice is a request of its own in the batch
# the protobuf field types (protos/moe_lightning/api/generation/v1/generation.proto)
INT32_MAX = 2**31 - 1  # max_new_tokens, top_k, a token id
UINT64_MAX = 2**64 - 1  # seed
FLOAT32_MAX = 3.4028234663852886e38  # temperature, top_p: a larger double would become inf

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]
# No-op values of refused fields (what a client sends when it asks for nothing, as null does)
_NOTHING: tuple[Any, ...] = (None,)


class UnsupportedField(ValueError):
    """A field set to something this server does not do, or beyond its limits; 400 naming `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _field_error(loc: tuple[str | int, ...], value: Any, kind: str, message: str) -> InitErrorDetails:
    # with no context the message is not a template: a field name's braces stay as they are
    return InitErrorDetails(type=PydanticCustomError(kind, message), loc=loc, input=value)


def _printable(key: str) -> str:
    """A dict key as it can appear in an error (one with a lone surrogate cannot be sent as JSON)."""
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def _only_numbers(values: list[Any]) -> bool:
    """Whether every item is an int or a float, at C speed (a Python loop over 4 M token ids cost the
    event loop seconds)."""
    return set(map(type, values)) <= {int, float}


def _lone_surrogates(data: Any) -> Iterator[tuple[tuple[str | int, ...], str]]:
    """(where, the string) for every string of a parsed JSON body, keys included, that is not valid
    Unicode. Iterative: a deeply nested body must not raise RecursionError here."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while stack:
        loc, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    yield loc, value
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str) and not k.isascii() and _printable(k) != k:
                    yield (*loc, _printable(k)), k
                stack.append(((*loc, _printable(k) if isinstance(k, str) else k), v))
        elif isinstance(value, list):
            if _only_numbers(value):  # token ids: millions of them, and nothing to look into
                continue
            stack.extend(((*loc, i), v) for i, v in enumerate(value))


class _Fields(BaseModel):
    """A body part that refuses every field it does not declare, but those in IGNORED (accepted and
    dropped: they change nothing here) and those of REFUSED (known, not implemented: refused with why,
    unless set to a value that asks for nothing, as null does)."""

    model_config = ConfigDict(extra="ignore")  # only IGNORED's fields get past _check_fields undeclared

    IGNORED: ClassVar[frozenset[str]] = frozenset()
    REFUSED: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = {}  # name -> (why, the values that ask nothing)

    @model_validator(mode="before")
    @classmethod
    def _check_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # pydantic's own error: the body is not an object
        errors = cls._refused_first(data)
        for key, value in data.items():
            if not isinstance(key, str) or key in cls.model_fields or key in cls.IGNORED:
                continue
            name = _printable(key)
            refused = cls.REFUSED.get(key)
            if refused is None:
                errors.append(
                    _field_error(
                        (name,),
                        value,
                        "unknown_field",
                        f"{name} is not a field this server takes; docs/openai.md lists the fields it does",
                    )
                )
            elif not any(type(value) is type(v) and value == v for v in refused[1]):
                why = f"{name} is not supported: {refused[0]}"
                errors.append(_field_error((name,), value, "unsupported_field", why))
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return data

    @classmethod
    def _refused_first(cls, data: dict[str, Any]) -> list[InitErrorDetails]:
        """A refusal that explains the others (said first, in place of theirs)."""
        return []


class _Body(_Fields):
    """A whole request body: every string in it must be valid Unicode, before any field is read."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        errors = [
            _field_error(
                loc,
                None,  # not the string itself: it cannot be written into the JSON error
                "lone_surrogate",
                "not valid Unicode: it has a lone surrogate (an unpaired \\ud800-\\udfff escape), which "
                "cannot be encoded as UTF-8",
            )
            for loc, _ in _lone_surrogates(data)
        ]
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors[:1])
        return data


class StreamOptions(_Fields):
    IGNORED = frozenset({"include_obfuscation"})  # random padding of the chunks: none is added here

    include_usage: bool = False


_TOOLS = "tool and function calling is not implemented"
# Known fields of both APIs that this server does not implement (until an issue implements one)
_REFUSED_SAMPLING: dict[str, tuple[str, tuple[Any, ...]]] = {
    "tools": (_TOOLS, (None, [])),
    "tool_choice": (_TOOLS, (None, "none")),
    "functions": (_TOOLS, (None, [])),
    "function_call": (_TOOLS, (None, "none")),
    "parallel_tool_calls": (_TOOLS, (None, False, True)),  # without tools it asks nothing either way
    "response_format": ("structured output (JSON mode, json_schema) is not implemented", (None, {"type": "text"})),
    "logit_bias": ("biasing tokens is not implemented", (None, {})),
    "audio": ("audio output is not implemented", _NOTHING),
    "modalities": ("only text output is implemented", (None, ["text"])),
    "prediction": ("predicted outputs are not implemented", _NOTHING),
    "web_search_options": ("web search is not implemented", _NOTHING),
    "reasoning_effort": ("this server's models take no reasoning effort", _NOTHING),
    "verbosity": ("this server's models take no verbosity", _NOTHING),
    "moderation": ("moderation of the input and output is not implemented", _NOTHING),
}


class _Sampling(_Body):
    # OpenAI's fields that only OpenAI's own service acts on (accounting, storage, caching, routing):
    # nothing here would change if they were honoured, so they are accepted and dropped
    IGNORED = frozenset(
        {
            "user",
            "metadata",
            "store",
            "service_tier",
            "prompt_cache_key",
            "prompt_cache_options",
            "prompt_cache_retention",
            "safety_identifier",
        }
    )
    REFUSED = _REFUSED_SAMPLING

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=FLOAT32_MAX, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=UINT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, allow_inf_nan=False)
    # vLLM's extras
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    ignore_eos: bool = False

    def refuse_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise UnsupportedField(name, f"{name} is not supported: leave it 0")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedField("stream_options", "stream_options is only allowed with stream: true")

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def base_input(self, max_tokens: int | None, logprobs: int, choice: int) -> generation_pb2.GenerationInput:
        """The sampling part of one choice's input; choice i of a seeded request gets seed + i (mod
        2^64, the field's range), so the n choices differ and each is reproducible."""
        m = generation_pb2.GenerationInput(stop=self.stops(), ignore_eos=self.ignore_eos, logprobs=logprobs)
        if max_tokens is not None:
            m.max_new_tokens = max_tokens
        if self.temperature is not None:
            m.temperature = self.temperature
        if self.top_p is not None:
            m.top_p = self.top_p
        if self.top_k is not None and self.top_k > 0:  # -1 and 0: no top-k, as in vLLM
            m.top_k = self.top_k
        if self.seed is not None:
            m.seed = (self.seed + choice) % (UINT64_MAX + 1)
        return m


def _check_count(prompts: int, n: int, max_inputs: int) -> None:
    if prompts * n > max_inputs:
        raise UnsupportedField(
            "prompt" if prompts > 1 else "n",
            f"this request asks for {prompts} prompts x {n} choices = {prompts * n} generations; one request "
            f"takes at most {max_inputs} (the server's max_batch_prompts): send fewer prompts per request",
        )


class CompletionRequest(_Sampling):
    prompt: Annotated[Prompt, SkipValidation]  # _prompt_shape validates it
    max_tokens: int | None = Field(default=16, ge=1, le=INT32_MAX)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        """The prompt's whole validation (the field skips pydantic's own): one clear error for a prompt of
        the wrong shape rather than one per member of the union, and at C speed for millions of token
        ids, which pydantic's union took seconds of the event loop to validate."""
        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise PydanticCustomError(
                "prompt_shape",
                "a prompt is a string, a list of strings, a list of token ids or a list of lists of token ids "
                "(got {what})",
                {"what": type(v).__name__},
            )
        if not v:
            raise PydanticCustomError("empty_prompt", "prompt is empty: give a string, a list of strings or token ids")
        kinds = set(map(type, v))  # C speed: a prompt may be millions of token ids
        if kinds == {str}:
            return v
        if kinds == {int} and min(v) >= 0 and max(v) <= INT32_MAX:
            return v  # one prompt of token ids in range: nothing to report
        rows = v if kinds == {list} else [v]
        for i, row in enumerate(rows):
            if set(map(type, row)) == {int} and min(row) >= 0 and max(row) <= INT32_MAX:
                continue
            for j, t in enumerate(row):
                if not isinstance(t, int) or isinstance(t, bool):
                    raise PydanticCustomError(
                        "prompt_shape",
                        "a prompt is a string, a list of strings, a list of token ids or a list of lists of "
                        "token ids (got {what})",
                        {"what": f"{type(t).__name__} at [{i}][{j}]" if rows is v else f"{type(t).__name__} at [{j}]"},
                    )
                if not 0 <= t <= INT32_MAX:
                    where = f"prompt {i}'s token {j}" if rows is v else f"token {j}"
                    raise PydanticCustomError(
                        "token_id_range",
                        "{where} is {t}: a token id is 0 to {max}",
                        {"where": where, "t": t if abs(t) < 10**30 else "out of range", "max": INT32_MAX},
                    )
        return v

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise UnsupportedField("prompt", "prompt is empty: give a string, a list of strings or token ids")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def inputs(
        self, max_prompt_tokens: int | None = None, max_inputs: int = MAX_BATCH_PROMPTS
    ) -> list[generation_pb2.GenerationInput]:
        """One input per choice: prompt i's n choices are choices i*n .. i*n+n-1 (OpenAI's order).
        `max_prompt_tokens` (the model's context at the gateway: an upper bound of the server's own
        limit) refuses a prompt no server could take before it is copied into protobuf; None: the
        server checks it; `max_inputs`: prompts x n at most (the server's max_batch_prompts)."""
        self.refuse_unsupported()
        if self.echo:
            raise UnsupportedField("echo", "echo is not supported: leave it false")
        if self.suffix:
            raise UnsupportedField("suffix", "suffix is not supported")
        if self.best_of not in (None, self.n):
            raise UnsupportedField("best_of", "best_of other than n is not supported")
        prompts = self.prompts()
        _check_count(len(prompts), self.n, max_inputs)
        if max_prompt_tokens is not None:
            for i, prompt in enumerate(prompts):
                where = f"prompt {i}" if len(prompts) > 1 else "prompt"
                if isinstance(prompt, str):
                    try:
                        check_text_size(prompt, max_prompt_tokens, CONTEXT_BOUND)
                    except InvalidRequestError as exc:
                        raise UnsupportedField("prompt", f"{where}: {exc}") from None
                elif len(prompt) > max_prompt_tokens:
                    raise UnsupportedField(
                        "prompt",
                        f"{where} has {len(prompt)} token ids; the model's context is {max_prompt_tokens} "
                        "tokens: send a shorter prompt",
                    )
        out = []
        for prompt in prompts:
            for _ in range(self.n):
                m = self.base_input(self.max_tokens, self.logprobs or 0, len(out))
                if isinstance(prompt, str):
                    m.text = prompt
                else:
                    m.token_ids.ids.extend(prompt)
                out.append(m)
        return out


class ChatMessageIn(_Fields):
    IGNORED = frozenset({"name"})  # a participant's name: our chat messages carry role and content only
    REFUSED = {
        "tool_calls": (_TOOLS, (None, [])),
        "tool_call_id": (_TOOLS, _NOTHING),
        "function_call": (_TOOLS, _NOTHING),
        # what an assistant message of OpenAI's (or vLLM's) carries besides its text, echoed back by
        # clients that append the response's message to the conversation
        "refusal": ("an assistant message's refusal is not implemented", _NOTHING),
        "audio": ("audio is not implemented", _NOTHING),
        "annotations": ("annotations are not implemented", (None, [])),
        "reasoning_content": ("reasoning content is not implemented", (None, "")),
    }

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]] | None = None

    @classmethod
    def _refused_first(cls, data: dict[str, Any]) -> list[InitErrorDetails]:
        # a tool result's own fields (tool_call_id, name) are refused because its role is
        role = data.get("role")
        if role not in ("tool", "function"):
            return []
        message = (
            f"role {role!r} is not supported: tool and function calling is not implemented, so there are no "
            "tool results to send"
        )
        return [_field_error(("role",), role, "unsupported_role", message)]

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, v: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        for part in v if isinstance(v, list) else []:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):  # parts joined by newlines, as vLLM joins them
            return "\n".join(part["text"] for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)

    def inputs(
        self, max_prompt_tokens: int | None = None, max_inputs: int = MAX_BATCH_PROMPTS
    ) -> list[generation_pb2.GenerationInput]:
        """One input per choice; `max_prompt_tokens` refuses a conversation no prompt of that many
        tokens could hold before n copies of it are built (as the orchestrator would refuse each)."""
        self.refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedField("top_logprobs", "top_logprobs needs logprobs: true")
        _check_count(1, self.n, max_inputs)
        texts = [m.text() for m in self.messages]
        try:
            check_conversation_size(texts, max_prompt_tokens, CONTEXT_BOUND)
        except InvalidRequestError as exc:
            raise UnsupportedField("messages", f"messages: {exc}") from None
        # the generated token's own log-probability comes with at least one: our top-k includes it
        k = max(1, self.top_logprobs or 0) if self.logprobs else 0
        max_tokens = self.max_completion_tokens or self.max_tokens
        messages = generation_pb2.ChatMessages(
            messages=[
                generation_pb2.ChatMessage(role="system" if m.role == "developer" else m.role, content=text)
                for m, text in zip(self.messages, texts, strict=True)
            ]
        )
        out = []
        for j in range(self.n):
            m = self.base_input(max_tokens, k, j)
            m.messages.CopyFrom(messages)
            out.append(m)
        return out
