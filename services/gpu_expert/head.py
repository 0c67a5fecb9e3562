"""The head of a step: rank 0 samples each sequence's next token and answers for the group; the
other ranks of a tensor-parallel group hold no LM head and answer nothing (docs/parallel.md)."""

from __future__ import annotations

import torch

from moe_lightning.logits_processors import process_logits
from moe_lightning.prompt_logprobs import compute_prompt_logprobs
from moe_lightning.sampling import (
    NOT_FINITE,
    PromptLogprobs,
    SequenceSampler,
    TokenLogprobs,
    sample,
    sampled_logprobs,
)
from moe_lightning.spec import ModelSpec
from moe_lightning.stages import head_logits
from moe_lightning.step_protocol import SequenceFault, SequenceWork
from moe_lightning.weights import ModelWeights
from services.gpu_expert.clock import StageClock
from services.gpu_expert.micro_batch import MicroBatchState
from services.gpu_expert.step_masks import StepMasks

Samplers = dict[int, SequenceSampler]  # each sequence's parameters and random stream
Sampled = tuple[list[int], dict[int, TokenLogprobs], dict[int, PromptLogprobs], dict[int, SequenceFault]]


class Head:
    def __init__(
        self, spec: ModelSpec, weights: ModelWeights, samplers: Samplers, clock: StageClock, masks: StepMasks
    ) -> None:
        self.spec, self.weights, self.samplers, self.clock, self.masks = spec, weights, samplers, clock, masks

    def sample(self, states: list[MicroBatchState], works: list[SequenceWork], step_id: int) -> Sampled:
        """Each sequence's sampled token from the logits of its last row (after its controls and grammar
        mask), their log-probabilities (the raw logits'), the prompt rows' where asked, and the
        sequences whose logits were not finite (they alone end; the others' tokens stand)."""
        t0 = self.clock.mark()
        hidden = torch.cat([st.hidden[st.last_rows] for st in states])  # (B, D)
        logits = head_logits(self.spec, self.weights.final_norm, self.weights.lm_head, hidden)  # (B, V)
        chosen = [self.samplers[w.seq_id] for w in works]
        late = self._masks_that_followed(works, step_id)
        masks = [w.token_mask for w in works] if any(w.token_mask is not None for w in works) else []
        processed = process_logits(logits, chosen, self.spec.eos_token_ids, masks)
        # the batch at once: one copy to the host for the tokens, one for the log-probabilities
        tokens = sample(processed, [c.params for c in chosen], [c.next_key() for c in chosen]).tolist()
        bad = {b for b, t in enumerate(tokens) if t == NOT_FINITE}
        faults = {works[b].seq_id: _fault(logits[b], processed[b]) for b in sorted(bad)} | late
        asked = [(b, tokens[b], c.params.logprobs) for b, c in enumerate(chosen) if c.params.logprobs and b not in bad]
        logprobs = {works[b].seq_id: lp for (b, _, _), lp in zip(asked, sampled_logprobs(logits, asked), strict=True)}
        prompt: dict[int, PromptLogprobs] = {}
        if any(c.params.prompt_logprobs is not None for c in chosen):
            prompt = compute_prompt_logprobs(
                self.spec,
                self.weights,
                [st.hidden for st in states],
                [[(w.seq_id, w.token_ids, w.start) for w in st.works] for st in states],
                self.samplers,
            )
        self.clock.span("head", "head", -1, -1, t0, self.clock.mark())
        return tokens, logprobs, prompt, faults

    def seq_ids(self, works: list[SequenceWork]) -> list[int]:
        return [w.seq_id for w in works]

    def _masks_that_followed(self, works: list[SequenceWork], step_id: int) -> dict[int, SequenceFault]:
        """Sets the masks that came apart from the step (waiting for them here, after every layer ran);
        the rows whose masks did not come in time fault alone (sampled without one, their tokens unused)."""
        following = [w for w in works if w.mask_follows]
        if not following:
            return {}
        delivered = self.masks.wait(step_id)
        if delivered is None:
            error = SequenceFault(
                f"the token masks of this request's grammar did not reach gpu_expert within "
                f"{self.masks.timeout:g} s (--grammar-mask-timeout) of its step's sampling; the request was "
                "not completed, retry it",
                invalid_argument=False,
            )
            return {w.seq_id: error for w in following}
        for w in following:
            w.token_mask = delivered.get(w.seq_id)
        return {}


class NoHead:
    """A rank other than 0: rank 0 samples and reports the step."""

    def sample(self, states: list[MicroBatchState], works: list[SequenceWork], step_id: int) -> Sampled:
        return [], {}, {}, {}

    def seq_ids(self, works: list[SequenceWork]) -> list[int]:
        return []


def head_part(
    leads: bool, spec: ModelSpec, weights: ModelWeights, samplers: Samplers, clock: StageClock, masks: StepMasks
) -> Head | NoHead:
    return Head(spec, weights, samplers, clock, masks) if leads else NoHead()


def _fault(raw: torch.Tensor, processed: torch.Tensor) -> SequenceFault:
    """Why a row could not be sampled, told from its raw and processed logits (V,) (a host read per
    faulty row: a fault is rare, the step's sound rows pay nothing)."""
    if not bool(raw.isfinite().all()):
        return SequenceFault(
            "the model produced non-finite logits (NaN or inf) for this sequence: its weights or configuration "
            "overflow; the request was not completed",
            invalid_argument=False,
        )
    if bool(processed.isneginf().all()):
        return SequenceFault(
            "this request's controls allow no token here (its grammar, min_tokens, stop_token_ids and "
            "logit_bias together exclude every token)",
            invalid_argument=True,
        )
    return SequenceFault(
        "this request's sampling controls made its logits non-finite (NaN or inf): use a repetition_penalty, "
        "frequency_penalty, presence_penalty or logit_bias within their ranges (docs/openai.md)",
        invalid_argument=True,
    )
