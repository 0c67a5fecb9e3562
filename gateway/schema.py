"""The OpenAI request bodies we take, as pydantic models (FastAPI validates with them), and what
each becomes: one GenerationInput per choice. Fields we cannot honour are refused with the field
named, never silently ignored; fields that change nothing here (user, ...) are accepted."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from moe_lightning.api.generation.v1 import generation_pb2

MAX_CHOICES = 16  # n: each choice is a request of its own in the batch


class UnsupportedField(ValueError):
    """A field set to something this server does not do; 400 naming `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients send fields we have no use for (user, ...)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = Field(default=None, ge=-1)
    ignore_eos: bool = False

    def refuse_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise UnsupportedField(name, f"{name} is not supported: leave it 0")
        if self.logit_bias:
            raise UnsupportedField("logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedField("stream_options", "stream_options is only allowed with stream: true")

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def base_input(self, max_tokens: int | None, logprobs: int, choice: int) -> generation_pb2.GenerationInput:
        """The sampling part of one choice's input; choice i of a seeded request gets seed + i, so the
        n choices differ and each is reproducible."""
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
            m.seed = self.seed + choice
        return m


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise UnsupportedField("prompt", "prompt is empty: give a string, a list of strings or token ids")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def inputs(self) -> list[generation_pb2.GenerationInput]:
        """One input per choice: prompt i's n choices are choices i*n .. i*n+n-1 (OpenAI's order)."""
        self.refuse_unsupported()
        if self.echo:
            raise UnsupportedField("echo", "echo is not supported: leave it false")
        if self.suffix:
            raise UnsupportedField("suffix", "suffix is not supported")
        if self.best_of not in (None, self.n):
            raise UnsupportedField("best_of", "best_of other than n is not supported")
        out = []
        for prompt in self.prompts():
            for _ in range(self.n):
                m = self.base_input(self.max_tokens, self.logprobs or 0, len(out))
                if isinstance(prompt, str):
                    m.text = prompt
                else:
                    m.token_ids.ids.extend(prompt)
                out.append(m)
        return out


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, ...

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]] | None = None

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
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def inputs(self) -> list[generation_pb2.GenerationInput]:
        self.refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedField("top_logprobs", "top_logprobs needs logprobs: true")
        # the generated token's own log-probability comes with at least one: our top-k includes it
        k = max(1, self.top_logprobs or 0) if self.logprobs else 0
        max_tokens = self.max_completion_tokens or self.max_tokens
        messages = generation_pb2.ChatMessages(
            messages=[
                generation_pb2.ChatMessage(role="system" if m.role == "developer" else m.role, content=m.text())
                for m in self.messages
            ]
        )
        out = []
        for j in range(self.n):
            m = self.base_input(max_tokens, k, j)
            m.messages.CopyFrom(messages)
            out.append(m)
        return out
