"""Generation requests and results as domain objects (protobuf stays at the service edge)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_lightning.sampling import SamplingParams, TokenLogprobs
from moe_lightning.spec import ModelSpec

FINISH_EOS = "eos"
FINISH_STOP = "stop"
FINISH_LENGTH = "length"


class InvalidRequestError(ValueError):
    """The request cannot be served; the message says what is allowed."""


@dataclass(slots=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    request_id: str = ""

    def validate(self, spec: ModelSpec) -> None:
        """The model's own limits only; moe_lightning.validation.validate checks a server's too."""
        from moe_lightning.validation import RequestLimits, validate  # here: that module imports this one

        validate(self, RequestLimits.of(spec))


@dataclass(slots=True)
class GenerationResult:
    token_ids: list[int]
    text: str | None
    finish_reason: str
    prompt_tokens: int
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per generated token, when asked

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)
