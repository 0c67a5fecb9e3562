"""A GenerationInput's sampling controls, prompt log-probabilities and grammar as domain objects: what the
public API reads besides the prompt (docs/api.md). The checks are moe_lightning/validation.py's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_lightning.api.generation.v1 import generation_pb2
from moe_lightning.request import InvalidRequestError
from moe_lightning.sampling import SamplingParams
from moe_lightning.service.convert import sampling_controls_from_pb
from moe_lightning.validation import sampling_params

if TYPE_CHECKING:
    from moe_lightning.grammar import GrammarSpec

GRAMMAR_KINDS = {
    generation_pb2.GRAMMAR_KIND_JSON_OBJECT: "json_object",
    generation_pb2.GRAMMAR_KIND_JSON_SCHEMA: "json_schema",
    generation_pb2.GRAMMAR_KIND_REGEX: "regex",
    generation_pb2.GRAMMAR_KIND_CHOICE: "choice",
    generation_pb2.GRAMMAR_KIND_TOOL_CALLS: "tool_calls",
}
GRAMMAR_KINDS_TO_PB = {v: k for k, v in GRAMMAR_KINDS.items()}


def sampling_from_input(m: generation_pb2.GenerationInput) -> SamplingParams:
    return sampling_params(
        m.temperature if m.HasField("temperature") else 0.0,
        m.top_k if m.HasField("top_k") else 0,
        m.top_p if m.HasField("top_p") else 1.0,
        m.seed if m.HasField("seed") else None,
        m.logprobs,
        **sampling_controls_from_pb(m),
    )


def grammar_from_input(m: generation_pb2.GenerationInput) -> GrammarSpec | None:
    if not m.HasField("grammar"):
        return None
    kind = GRAMMAR_KINDS.get(m.grammar.kind)
    if kind is None:
        raise InvalidRequestError(
            f"grammar.kind must be one of {', '.join(GRAMMAR_KINDS.values())} (GRAMMAR_KIND_*), got {m.grammar.kind}"
        )
    from moe_lightning.grammar import GrammarError, GrammarKind, GrammarSpec

    try:
        return GrammarSpec(GrammarKind(kind), m.grammar.source)
    except GrammarError as exc:
        raise InvalidRequestError(f"grammar: {exc}") from None
