"""Generation requests and results as domain objects (protobuf stays at the service edge). What a
request must satisfy is moe_lightning.validation's: `validate(request, RequestLimits.of(spec))` checks
it against the model's own limits, as the in-process engine does."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moe_lightning.sampling import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from moe_lightning.grammar import GrammarSpec

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
    grammar: GrammarSpec | None = None  # structured output: the orchestrator masks what it does not allow
    echo: bool = False  # return the prompt's text with the result
    skip_special_tokens: bool = True  # False: the output's text keeps them (a tool-call parser reads them)


@dataclass(slots=True)
class GenerationResult:
    token_ids: list[int]
    text: str | None
    finish_reason: str
    prompt_tokens: int
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per generated token, when asked
    preemptions: int = 0  # times its KV was freed and its tokens re-prefilled (orchestrator/batcher.py)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.., when asked

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)
