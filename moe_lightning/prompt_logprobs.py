"""The log-probability of each prompt token given the tokens before it, computed in the prefill the
system runs anyway: the head over every prompt row of the sequences that ask (echo with logprobs,
prompt_logprobs; docs/openai.md), in blocks of rows so that no more than BLOCK_BYTES of logits exist
at once, whatever the batch. Exact to the log_softmax of the model's logits at each position.

A prompt prefilled in chunks over several steps (a long one, or a mixed step's budget) gets each
chunk's entries in its step; the last row of a chunk predicts the first token of the next chunk, so
its log-softmax (one V-sized row per such sequence) waits in the sequence's sampler for that step.

Shapes: T rows of a micro-batch, D hidden, V vocabulary, R rows of a block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moe_lightning.sampling import PromptLogprobs, SequenceSampler, TokenLogprobs
from moe_lightning.spec import ModelSpec
from moe_lightning.stages import head_logits
from moe_lightning.weights import ModelWeights

BLOCK_BYTES = 64 << 20  # fp32 logits of one block of rows


@dataclass(slots=True)
class _Target:
    seq_id: int
    hidden: torch.Tensor  # (D,) the row that predicts the token
    token: int  # the prompt token at `position`
    position: int
    top: int


def _entry(lp: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """lp: (V,) log-softmax."""
    if top:
        values, ids = torch.topk(lp, min(top, lp.shape[-1]))
        return TokenLogprobs(token, float(lp[token]), ids.tolist(), values.tolist())
    return TokenLogprobs(token, float(lp[token]), [], [])


def compute_prompt_logprobs(
    spec: ModelSpec,
    weights: ModelWeights,
    hiddens: Sequence[torch.Tensor],
    works: Sequence[Sequence[tuple[int, list[int], int]]],
    samplers: dict[int, SequenceSampler],
) -> dict[int, PromptLogprobs]:
    """hiddens: per micro-batch its final hidden states (T, D); works: per micro-batch, its sequences'
    (seq id, token ids, start) in row order. Returns seq id -> the entries this step computed for it."""
    targets: list[_Target] = []
    # seq id -> the entry of this chunk's first token, which the last row of the chunk before predicted
    out: dict[int, PromptLogprobs] = {}
    pend: list[tuple[int, torch.Tensor]] = []  # (seq id, the last row of a chunk short of the prompt's end)
    for hidden, mb in zip(hiddens, works, strict=True):
        row = 0
        for seq_id, ids, start in mb:
            sampler = samplers.get(seq_id)
            n = len(ids)
            if sampler is None or sampler.params.prompt_logprobs is None or start >= sampler.prompt_len:
                row += n
                continue
            top, prompt_len = sampler.params.prompt_logprobs, sampler.prompt_len
            if start > 0 and sampler.pending_logprobs is not None:  # the previous chunk's last row predicts ids[0]
                out[seq_id] = PromptLogprobs(start, [_entry(sampler.pending_logprobs, ids[0], top)])
            sampler.pending_logprobs = None
            end = min(start + n, prompt_len)
            for q in range(start + 1, end):  # target positions whose predicting row is in this chunk
                targets.append(_Target(seq_id, hidden[row + q - 1 - start], ids[q - start], q, top))
            if start + n < prompt_len:
                pend.append((seq_id, hidden[row + n - 1]))
            row += n
    vocab = weights.lm_head.shape[0]
    block = max(1, BLOCK_BYTES // (4 * vocab))
    for i in range(0, len(targets), block):
        chunk = targets[i : i + block]
        logits = head_logits(spec, weights.final_norm, weights.lm_head, torch.stack([t.hidden for t in chunk]))
        lps = torch.log_softmax(logits.float(), dim=-1).cpu()  # (R, V)
        for t, lp in zip(chunk, lps, strict=True):
            entry = _entry(lp, t.token, t.top)
            if t.seq_id in out:
                out[t.seq_id].entries.append(entry)
            else:
                out[t.seq_id] = PromptLogprobs(t.position, [entry])
    if pend:
        logits = head_logits(spec, weights.final_norm, weights.lm_head, torch.stack([h for _, h in pend]))
        for (seq_id, _), lp in zip(pend, torch.log_softmax(logits.float(), dim=-1).cpu(), strict=True):
            samplers[seq_id].pending_logprobs = lp  # (V,): until the next chunk's step
    return out
