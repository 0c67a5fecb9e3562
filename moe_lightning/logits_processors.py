"""What changes a step's logits before sampling, for the whole batch at once (docs/openai.md, "Sampling").

Per sequence: the token mask of its grammar (structured output; the orchestrator fills it from the
grammar's state, moe_lightning/grammar.py, and the step carries it), logit_bias, min_tokens (EOS and
stop_token_ids masked until that many tokens are out), and the repetition, frequency and presence
penalties over the tokens the head has seen. Each is one batched tensor operation over the rows that
ask for it, on the device the logits are on: nothing loops over a vocabulary in Python, and rows that
ask for nothing are not touched (nor copied). The order is vLLM's: the grammar's mask and
min_tokens, the bias, then the penalties; the log-probabilities a request gets back are the raw
logits' (vLLM's default), as OpenAI's are.

Shapes: B rows (sequences of the step), V the vocabulary (the logits' width), W = ceil(V / 32) words
of a token mask, R the rows a control applies to.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from moe_lightning.sampling import SequenceSampler

BITS = 32  # tokens per word of a token mask (xgrammar's and llguidance's layout: bit t % 32 of word t // 32)


def mask_words(vocab_size: int) -> int:
    return -(-vocab_size // BITS)


def apply_token_masks(logits: torch.Tensor, rows: Sequence[int], masks: Sequence[bytes]) -> None:
    """In place: for each row, the tokens its mask does not allow become -inf. masks: W little-endian
    int32 words each (bytes, as the step carries them)."""
    if not rows:
        return
    vocab = logits.shape[-1]
    words = torch.from_numpy(np.frombuffer(b"".join(masks), dtype="<i4").reshape(len(rows), -1).copy())
    words = words.to(logits.device, non_blocking=True)  # (R, W)
    shifts = torch.arange(BITS, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]  # (R, V)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _padded(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """(R, longest) token ids, `pad` where a row is shorter."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out.to(device)


def _apply_penalties(logits: torch.Tensor, rows: list[int], samplers: list[SequenceSampler]) -> None:
    vocab = logits.shape[-1]
    device = logits.device
    index = torch.tensor(rows, device=device)
    sub = logits[index]  # (R, V)
    outputs = _padded([s.output for s in samplers], vocab, device)  # (R, L); pad = V, cut off below
    counts = torch.zeros(len(rows), vocab + 1, device=device, dtype=sub.dtype)
    counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=sub.dtype))
    counts = counts[:, :vocab]  # (R, V) how often each token was generated
    rep = torch.tensor([s.params.repetition_penalty for s in samplers], device=device, dtype=sub.dtype)[:, None]
    if bool((rep != 1.0).any()):
        prompts = _padded([(s.tokens or [])[: s.prompt_len] for s in samplers], vocab, device)
        seen = torch.zeros(len(rows), vocab + 1, device=device, dtype=torch.bool)
        seen.scatter_(1, prompts, True)
        seen = seen[:, :vocab] | (counts > 0)  # (R, V) in the prompt or the output
        # transformers' and vLLM's rule: a seen token's positive logit is divided, a negative one multiplied
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([s.params.frequency_penalty for s in samplers], device=device, dtype=sub.dtype)[:, None]
    pres = torch.tensor([s.params.presence_penalty for s in samplers], device=device, dtype=sub.dtype)[:, None]
    sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    logits[index] = sub


def process_logits(
    logits: torch.Tensor,
    samplers: Sequence[SequenceSampler],
    eos_ids: Sequence[int],
    masks: Sequence[bytes | None] = (),
) -> torch.Tensor:
    """logits: (B, V) raw, fp32 -> the logits to sample from: `logits` itself when no row asks for
    anything, else a processed copy (the raw ones stay for the log-probabilities). masks: per row, a
    grammar's token mask or None (empty: none at all). A row whose controls together allow no token
    (a grammar that can only end, under min_tokens) keeps its grammar's mask alone: the grammar wins."""
    masked = [b for b, m in enumerate(masks) if m is not None]
    # a sample that a chunk short of its prompt's end draws is thrown away: nothing to process for it
    active = [b for b, s in enumerate(samplers) if s.params.processed and s.complete]
    if not masked and not active:
        return logits
    out = logits.clone()
    if masked:
        apply_token_masks(out, masked, [masks[b] for b in masked])  # type: ignore[misc]
    short = [b for b in active if samplers[b].draws < samplers[b].params.min_tokens]
    if short:
        vocab = out.shape[-1]
        pairs = [
            (i, t) for i, b in enumerate(short) for t in {*eos_ids, *samplers[b].params.stop_token_ids} if t < vocab
        ]
        keep = torch.zeros(len(short), vocab, dtype=torch.bool)
        if pairs:
            keep[torch.tensor([i for i, _ in pairs]), torch.tensor([t for _, t in pairs])] = True
        rows = torch.tensor(short, device=out.device)
        out[rows] = out[rows].masked_fill(keep.to(out.device), float("-inf"))
    biased = [b for b in active if samplers[b].params.logit_bias]
    if biased:
        vocab = out.shape[-1]  # validation refuses ids beyond it first
        entries = [(b, tok, bias) for b in biased for tok, bias in samplers[b].params.logit_bias if tok < vocab]
        if entries:
            rows_t, toks_t = (torch.tensor(col, device=out.device) for col in list(zip(*entries, strict=True))[:2])
            values = torch.tensor([e[2] for e in entries], device=out.device, dtype=out.dtype)
            out.index_put_((rows_t, toks_t), values, accumulate=True)
    penalized = [b for b in active if samplers[b].params.penalized]
    if penalized:
        _apply_penalties(out, penalized, [samplers[b] for b in penalized])
    if masked and short:
        dead = [b for b in masked if b in set(short) and bool(torch.isinf(out[b]).all())]
        if dead:
            out[dead] = logits[dead]
            apply_token_masks(out, dead, [masks[b] for b in dead])  # type: ignore[misc]
    return out
