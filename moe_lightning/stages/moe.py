"""Router and expert FFN, with tokens grouped by expert: one GEMM pair per active expert."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from moe_lightning.stages.linear import linear
from moe_lightning.weights import ExpertWeights


def route(
    x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool, p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (T, D), router: (E, D) -> weights (T, A) in x's dtype, expert ids (T, A).

    `normalize`: divide the top-k weights by their L_p norm (p = 1: they sum to 1; DBRX sets its p)."""
    logits = linear(x, router)  # (T, E)
    probs = torch.softmax(logits.float(), dim=-1)  # (T, E) in fp32, as the reference
    weights, ids = torch.topk(probs, top_k, dim=-1)  # (T, A)
    if normalize:
        norm = weights.sum(dim=-1, keepdim=True) if p == 1.0 else torch.norm(weights, p=p, dim=-1, keepdim=True)
        weights = weights / norm
    return weights.to(x.dtype), ids


def expert_ffn(expert: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
    # x: (n, D) -> (n, D); SwiGLU with fused gate/up
    if expert.w13.device != x.device:  # an expert placed on the host: compute where its weights live
        return expert_ffn(expert, x.to(expert.w13.device)).to(x.device)
    gate_up = linear(x, expert.w13)  # (n, 2I)
    gate, up = gate_up.chunk(2, dim=-1)  # (n, I) each
    return linear(F.silu(gate) * up, expert.w2)  # (n, D)


def experts_forward(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: Sequence[ExpertWeights],
) -> torch.Tensor:
    """Weighted sum of each token's top-k experts. x: (T, D), weights/ids: (T, A) -> (T, D).

    `experts[e]` is only touched for experts that received tokens, so a caller can hand in a lazy
    sequence that fetches streamed pages on demand.
    """
    top_k = ids.shape[1]
    flat_ids = ids.reshape(-1)  # (T * A,)
    order = torch.argsort(flat_ids, stable=True)  # (T * A,) assignments grouped by expert
    counts = torch.bincount(flat_ids, minlength=len(experts)).tolist()
    flat_weights = weights.reshape(-1)
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        assignment = order[start : start + n]  # (n,)
        start += n
        token = assignment // top_k  # (n,)
        y = expert_ffn(experts[e], x[token])  # (n, D)
        out.index_add_(0, token, y * flat_weights[assignment, None])
    return out


def expert_token_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) number of tokens routed to each expert; the input to hot-expert residency."""
    return torch.bincount(ids.reshape(-1), minlength=num_experts)
