"""The OpenAI request bodies we take, as pydantic models (FastAPI validates with them), and what
each becomes: one GenerationInput per choice. Fields we cannot honour are refused with the field
named, never silently ignored; fields that change nothing here (user, ...) are accepted.

Every value that passes validation fits its protobuf field (the bounds below are the proto's types),
and every string is valid Unicode (a lone surrogate cannot be encoded as UTF-8, so protobuf, and the
JSON error that echoed it, would fail): no body reaches an exception that is not a 400 naming its
field. The same models read the OpenAI Batch files of `moe-lightning run` (commands/openai_batch.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, SkipValidation, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from gateway import responses
from gateway.bounds import NUMBER, check_lengths, check_metadata
from gateway.chat_output import ChatOutput
from gateway.fields import NOTHING, Body, Fields, UnsupportedField, field_error
from gateway.structured import GUIDED, request_grammar
from gateway.tools import NO_FORMAT, check_tool_choice, forcing_grammar, tool_calls_pb, tool_spec_pb, tool_specs
from moe_lightning.api.generation.v1 import generation_pb2
from moe_lightning.reasoning import KEEPS_SPECIAL_TOKENS
from moe_lightning.request import InvalidRequestError
from moe_lightning.validation import (
    CONTEXT_BOUND,
    MAX_BATCH_PROMPTS,
    check_conversation_size,
    check_text_size,
    sampling_params,
)

MAX_CHOICES = 16  # n: each choice is a request of its own in the batch
# the protobuf field types (protos/moe_lightning/api/generation/v1/generation.proto)
INT32_MAX = 2**31 - 1  # max_new_tokens, top_k, a token id
UINT64_MAX = 2**64 - 1  # seed
FLOAT32_MAX = 3.4028234663852886e38  # temperature, top_p: a larger double would become inf

TokenId = Annotated[int, NUMBER, Field(ge=0, le=INT32_MAX)]
Float32 = Annotated[float, NUMBER, Field(ge=-FLOAT32_MAX, le=FLOAT32_MAX, allow_inf_nan=False)]
Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class StreamOptions(Fields):
    IGNORED = frozenset({"include_obfuscation"})  # random padding of the chunks: none is added here

    include_usage: bool = False


_TOOLS = "the completions API takes no tools: send them to /v1/chat/completions"
_FUNCTIONS = "the deprecated functions API is not implemented: send tools and tool_choice"
# Known fields of both APIs that this server does not implement (until an issue implements one)
_REFUSED_SAMPLING: dict[str, tuple[str, tuple[Any, ...]]] = {
    "tools": (_TOOLS, (None, [])),
    "tool_choice": (_TOOLS, (None, "none")),
    "functions": (_FUNCTIONS, (None, [])),
    "function_call": (_FUNCTIONS, (None, "none")),
    "parallel_tool_calls": (_TOOLS, (None, False, True)),  # without tools it asks nothing either way
    "audio": ("audio output is not implemented", NOTHING),
    "modalities": ("only text output is implemented", (None, ["text"])),
    "prediction": ("predicted outputs are not implemented", NOTHING),
    "web_search_options": ("web search is not implemented", NOTHING),
    "reasoning_effort": ("reasoning_effort is read by a chat template: send it to /v1/chat/completions", NOTHING),
    "verbosity": ("this server's models take no verbosity", NOTHING),
    "moderation": ("moderation of the input and output is not implemented", NOTHING),
}

# the chat API takes tools (gateway/tools.py) and a reasoning effort (for the chat template, as vLLM passes it)
_CHAT_TAKES = ("tools", "tool_choice", "parallel_tool_calls", "reasoning_effort")
_REFUSED_CHAT = {k: v for k, v in _REFUSED_SAMPLING.items() if k not in _CHAT_TAKES}


class _Sampling(Body):
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
    max_tokens: Annotated[int | None, NUMBER] = Field(default=None, ge=1, le=INT32_MAX)
    temperature: Annotated[float | None, NUMBER] = Field(default=None, ge=0.0, le=FLOAT32_MAX, allow_inf_nan=False)
    top_p: Annotated[float | None, NUMBER] = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    n: Annotated[int, NUMBER] = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: Annotated[int | None, NUMBER] = Field(default=None, ge=0, le=UINT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # the sampling controls: what is allowed is SamplingParams' (checked in refuse_unsupported); these
    # bounds only keep each value within its protobuf field
    presence_penalty: Float32 = 0.0
    frequency_penalty: Float32 = 0.0
    logit_bias: dict[str, Annotated[float, NUMBER]] | None = None  # OpenAI's: token id (as a string) -> bias
    response_format: dict[str, Any] | None = None  # text, json_object or json_schema (gateway/structured.py)
    # vLLM's extras
    top_k: Annotated[int | None, NUMBER] = Field(default=None, ge=-1, le=INT32_MAX)
    ignore_eos: bool = False
    repetition_penalty: Float32 | None = None
    min_tokens: Annotated[int, NUMBER] = Field(default=0, ge=0, le=INT32_MAX)
    stop_token_ids: list[TokenId] | None = None
    prompt_logprobs: Annotated[int | None, NUMBER] = Field(default=None, ge=0, le=20)
    # (their shapes are gateway/structured.py's to check, with messages of its own)
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any) -> Any:
        """Lists counted and metadata checked before any field is modelled (gateway/bounds.py)."""
        try:
            check_lengths(data)
            check_metadata(data.get("metadata") if isinstance(data, dict) else None)
        except UnsupportedField as exc:
            where = tuple(exc.param.split("."))
            error = field_error(where, None, "too_long", str(exc))
            raise ValidationError.from_exception_data(cls.__name__, [error]) from None
        return data

    def refuse_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise UnsupportedField("stream_options", "stream_options is only allowed with stream: true")
        try:  # the one definition (moe_lightning/sampling.py), answered as a 400 naming the field here
            sampling_params(0.0, 0, 1.0, None, 0, **self._controls())
        except InvalidRequestError as exc:
            message = str(exc)
            raise UnsupportedField(message.split(" ", 1)[0], message) from None

    def _controls(self) -> dict[str, Any]:
        """The sampling controls as SamplingParams' fields; what they are checked against is its rules."""
        bias = []
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or int(key) > INT32_MAX:
                raise UnsupportedField("logit_bias", f"logit_bias keys are token ids (0 to {INT32_MAX}), got {key!r}")
            bias.append((int(key), value))
        return {
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "logit_bias": tuple(sorted(bias)),
            "min_tokens": self.min_tokens,
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "prompt_logprobs": self.prompt_logprobs,
        }

    def grammar(self) -> generation_pb2.Grammar | None:
        guided = {name: getattr(self, name) for name in GUIDED}
        return request_grammar(self.response_format, guided)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def base_input(self, max_tokens: int | None, logprobs: int, choice: int) -> generation_pb2.GenerationInput:
        """The sampling part of one choice's input; choice i of a seeded request gets seed + i (mod
        2^64, the field's range), so the n choices differ and each is reproducible."""
        controls = self._controls()
        m = generation_pb2.GenerationInput(
            stop=self.stops(),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=dict(controls["logit_bias"]),
            min_tokens=self.min_tokens,
            stop_token_ids=controls["stop_token_ids"],
        )
        if self.repetition_penalty is not None:
            m.repetition_penalty = self.repetition_penalty
        if self.prompt_logprobs is not None:
            m.prompt_logprobs = self.prompt_logprobs
        grammar = self.grammar()
        if grammar is not None:
            m.grammar.CopyFrom(grammar)
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
    # OpenAI's default for completions; 0 only with echo (scoring a prompt, nothing generated)
    max_tokens: Annotated[int | None, NUMBER] = Field(default=16, ge=0, le=INT32_MAX)
    logprobs: Annotated[int | None, NUMBER] = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int | None, NUMBER] = None

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

    def response(self, rid: str, model: str, outputs: Sequence[generation_pb2.GenerationOutput]) -> dict[str, Any]:
        """The text_completion of these outputs (one per choice), shaped as this body asked."""
        return responses.completion(
            rid,
            model,
            outputs,
            self.n,
            self.logprobs is not None,
            echo=self.echo,
            scoring=self.max_tokens == 0,
            prompt_logprobs=self.prompt_logprobs is not None,
        )

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
        if self.echo and self.stream:
            raise UnsupportedField("echo", "echo is not supported with stream: true; send stream: false")
        if self.max_tokens == 0 and not self.echo:
            raise UnsupportedField("max_tokens", "max_tokens 0 generates nothing: it is only allowed with echo: true")
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
                # max_tokens 0 (scoring): one token is generated, and the response leaves it out
                max_tokens = 1 if self.max_tokens == 0 else self.max_tokens
                m = self.base_input(max_tokens, self.logprobs or 0, len(out))
                if self.echo:
                    m.echo = True
                    if self.logprobs is not None and self.prompt_logprobs is None:
                        m.prompt_logprobs = self.logprobs  # the prompt's tokens get logprobs as the output's do
                if isinstance(prompt, str):
                    m.text = prompt
                else:
                    m.token_ids.ids.extend(prompt)
                out.append(m)
        return out


class ChatMessageIn(Fields):
    IGNORED = frozenset({"name"})  # a participant's name: our chat messages carry role and content only
    REFUSED: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = {
        "function_call": (_FUNCTIONS, NOTHING),
        # what an assistant message of OpenAI's (or vLLM's) carries besides its text, echoed back by
        # clients that append the response's message to the conversation
        "refusal": ("an assistant message's refusal is not implemented", NOTHING),
        "audio": ("audio is not implemented", NOTHING),
        "annotations": ("annotations are not implemented", (None, [])),
    }

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[Any] | None = None  # an assistant's (gateway/tools.py checks each)
    tool_call_id: str | None = None  # a tool result's
    reasoning_content: str | None = None  # an assistant's, for templates that render it back

    @classmethod
    def _refused_first(cls, data: dict[str, Any]) -> list[InitErrorDetails]:
        # the legacy function role's own fields are refused because its role is
        role = data.get("role")
        if role != "function":
            return []
        message = "role 'function' is not supported: send tool results as role 'tool' with their tool_call_id"
        return [field_error(("role",), role, "unsupported_role", message)]

    def to_pb(self, text: str, where: str) -> generation_pb2.ChatMessage:
        m = generation_pb2.ChatMessage(role="system" if self.role == "developer" else self.role, content=text)
        if self.tool_calls:
            if self.role != "assistant":
                raise UnsupportedField(f"{where}.tool_calls", f"{where}: only an assistant message has tool_calls")
            m.tool_calls.extend(tool_calls_pb(self.tool_calls, f"{where}.tool_calls"))
        if self.tool_call_id is not None:
            if self.role != "tool":
                raise UnsupportedField(f"{where}.tool_call_id", f"{where}: only a tool message has a tool_call_id")
            m.tool_call_id = self.tool_call_id
        elif self.role == "tool":
            raise UnsupportedField(
                f"{where}.tool_call_id", f"{where}: a tool message needs the tool_call_id it answers"
            )
        if self.reasoning_content:
            if self.role != "assistant":
                raise UnsupportedField(f"{where}.reasoning_content", f"{where}: only an assistant message reasons")
            m.reasoning_content = self.reasoning_content
        return m

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
    REFUSED = _REFUSED_CHAT
    messages: list[ChatMessageIn] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Annotated[int | None, NUMBER] = Field(default=None, ge=0, le=20)
    max_completion_tokens: Annotated[int | None, NUMBER] = Field(default=None, ge=1, le=INT32_MAX)
    tools: list[Any] | None = None  # OpenAI function tools (gateway/tools.py)
    tool_choice: Any = None  # none, auto (the default with tools), required, or a named function
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the chat template
    # OpenAI's, for reasoning models: the chat template's `reasoning_effort` (GPT-OSS's harmony template
    # writes it into the system message; a template that does not read it ignores it, as in vLLM)
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs, with reasoning_effort in it unless the kwargs name their own."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    def shapes(self, tool_format: str, reasoning_format: str) -> list[ChatOutput] | None:
        """Per choice, how its answer is read into the message (None: as plain text). A grammar (a
        response_format, or a tool_choice that forces calls) makes the output from its first token,
        leaving no room to think: its output is not read for reasoning."""
        tools = tool_format if self.tools_active(tool_format) else ""
        forced = self.grammar() is not None or (bool(tools) and self.tool_choice not in (None, "auto"))
        if forced:
            reasoning_format = ""
        if not tools and not reasoning_format:
            return None
        return [ChatOutput(tools, reasoning_format, self.template_kwargs()) for _ in range(self.n)]

    def response(
        self,
        rid: str,
        model: str,
        outputs: Sequence[generation_pb2.GenerationOutput],
        tool_format: str = "",
        reasoning_format: str = "",
    ) -> dict[str, Any]:
        top = (self.top_logprobs or 0) if self.logprobs else None
        return responses.chat_completion(rid, model, outputs, top, self.shapes(tool_format, reasoning_format))

    def tools_active(self, tool_format: str) -> bool:
        """Whether the output is parsed for tool calls: tools given and a choice other than none."""
        return bool(self.tools) and self.tool_choice != "none" and bool(tool_format)

    def inputs(
        self,
        max_prompt_tokens: int | None = None,
        max_inputs: int = MAX_BATCH_PROMPTS,
        tool_format: str = "",
        reasoning_format: str = "",
    ) -> list[generation_pb2.GenerationInput]:
        """One input per choice; `max_prompt_tokens` refuses a conversation no prompt of that many
        tokens could hold before n copies of it are built (as the orchestrator would refuse each).
        `tool_format`: how the server's model writes tool calls ("": it has none, so tools are refused);
        `reasoning_format`: how it writes its reasoning (harmony's channels are special tokens, kept)."""
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
                m.to_pb(text, f"messages.{i}") for i, (m, text) in enumerate(zip(self.messages, texts, strict=True))
            ]
        )
        if kwargs := self.template_kwargs():
            messages.template_kwargs_json = json.dumps(kwargs, ensure_ascii=False)
        tools = tool_specs(self.tools or [])
        check_tool_choice(self.tool_choice, tools)
        forcing = None
        if self.tools and self.tool_choice != "none":  # (none: the template is not shown them, as if absent)
            if not tool_format:
                raise UnsupportedField("tools", NO_FORMAT)
            messages.tools.extend(tool_spec_pb(t) for t in tools)
            messages.has_tools = True
            forcing = forcing_grammar(tool_format, tools, self.tool_choice, self.parallel_tool_calls)
            if forcing is not None and self.grammar() is not None:
                raise UnsupportedField("tool_choice", "tool_choice forces tool calls: it takes no response_format")
        out = []
        for j in range(self.n):
            m = self.base_input(max_tokens, k, j)
            m.messages.CopyFrom(messages)
            if self.tools_active(tool_format) or reasoning_format in KEEPS_SPECIAL_TOKENS:
                m.skip_special_tokens = False  # a format's markers may be special tokens ([TOOL_CALLS], <|channel|>)
            if forcing is not None:
                m.grammar.CopyFrom(forcing)
            out.append(m)
        return out
