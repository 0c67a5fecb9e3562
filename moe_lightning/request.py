"""Generation requests and results as domain objects (protobuf stays at the service edge)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_lightning.sampling import SamplingParams, TokenLogprobs
from moe_lightning.spec import ModelSpec

FINISH_EOS = "eos"
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
MAX_STOP_STRINGS = 16


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
        if not self.prompt_ids:
            raise InvalidRequestError("prompt is empty: give at least one token")
        bad = [t for t in self.prompt_ids if not 0 <= t < spec.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary; allowed: 0..{spec.vocab_size - 1}"
            )
        if self.max_new_tokens <= 0:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        total = len(self.prompt_ids) + self.max_new_tokens
        if total > spec.max_position_embeddings:
            raise InvalidRequestError(
                f"prompt ({len(self.prompt_ids)} tokens) + max_new_tokens ({self.max_new_tokens}) = {total} "
                f"exceeds the model's context of {spec.max_position_embeddings} tokens"
            )
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise InvalidRequestError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")


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
