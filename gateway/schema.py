"""The OpenAI request bodies we take, as pydantic models (FastAPI validates with them), and what
each becomes: one GenerationInput per choice. Fields we cannot honour are refused with the field
named, never silently ignored; fields that change nothing here (user, ...) are accepted.

Every value that passes validation fits its protobuf field (the bounds below are the proto's types),
and every string is valid Unicode (a lone surrogate cannot be encoded as UTF-8, so protobuf, and the
JSON error that echoed it, would fail): no body reaches an exception that is not a 400 naming its
field. The same models read the OpenAI Batch files of `moe-lightning run` (commands/openai_batch.py).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, SkipValidation, field_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from gateway.fields import NOTHING, Body, Fields, UnsupportedField, field_error
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


class StreamOptions(Fields):
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
    "audio": ("audio output is not implemented", NOTHING),
    "modalities": ("only text output is implemented", (None, ["text"])),
    "prediction": ("predicted outputs are not implemented", NOTHING),
    "web_search_options": ("web search is not implemented", NOTHING),
    "reasoning_effort": ("this server's models take no reasoning effort", NOTHING),
    "verbosity": ("this server's models take no verbosity", NOTHING),
    "moderation": ("moderation of the input and output is not implemented", NOTHING),
}


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


class ChatMessageIn(Fields):
    IGNORED = frozenset({"name"})  # a participant's name: our chat messages carry role and content only
    REFUSED: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = {
        "tool_calls": (_TOOLS, (None, [])),
        "tool_call_id": (_TOOLS, NOTHING),
        "function_call": (_TOOLS, NOTHING),
        # what an assistant message of OpenAI's (or vLLM's) carries besides its text, echoed back by
        # clients that append the response's message to the conversation
        "refusal": ("an assistant message's refusal is not implemented", NOTHING),
        "audio": ("audio is not implemented", NOTHING),
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
        return [field_error(("role",), role, "unsupported_role", message)]

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
