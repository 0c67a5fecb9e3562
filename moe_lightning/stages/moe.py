"""Router and expert FFN, with tokens grouped by expert: one GEMM pair per active expert."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_lightning.spec import ModelSpec
from moe_lightning.stages.linear import linear
from moe_lightning.weights import ExpertWeights


@dataclass(frozen=True, slots=True)
class Activation:
    """The FFNs' gated activation (spec.ACTIVATIONS): SwiGLU, silu(gate) * up; or, with a `limit`,
    GPT-OSS's clamped one, (up + 1) * gate * sigmoid(alpha * gate), the gate clamped above at `limit`
    and up to [-limit, limit]."""

    limit: float | None = None
    alpha: float = 1.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit is None:
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


SWIGLU = Activation()


def activation_of(spec: ModelSpec) -> Activation:
    if spec.activation == "clamped_swiglu":
        return Activation(spec.swiglu_limit, spec.swiglu_alpha)
    return SWIGLU


def route(
    x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool, p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (T, D), router: (E, D) -> weights (T, A) in fp32, expert ids (T, A).

    `normalize`: divide the top-k weights by their L_p norm (p = 1: they sum to 1; DBRX sets its p).
    The weights stay fp32, as transformers' Mixtral router keeps them: a bf16 model then weights and sums
    its experts' outputs in fp32 and rounds once, where the reference does (see `experts_forward`)."""
    logits = linear(x, router)  # (T, E)
    probs = torch.softmax(logits.float(), dim=-1)  # (T, E) in fp32, as the reference
    weights, ids = torch.topk(probs, top_k, dim=-1)  # (T, A)
    if normalize:
        norm = weights.sum(dim=-1, keepdim=True) if p == 1.0 else torch.norm(weights, p=p, dim=-1, keepdim=True)
        weights = weights / norm
    return weights, ids


def route_topk_softmax(
    x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's router: x: (T, D), router: (E, D), bias: (E,) -> weights (T, A) fp32 (a softmax over
    the top-k logits only, which sum to 1), expert ids (T, A)."""
    logits = linear(x, router) + bias  # (T, E)
    top, ids = torch.topk(logits, top_k, dim=-1)  # (T, A)
    return torch.softmax(top.float(), dim=-1), ids


def expert_ffn(expert: ExpertWeights, x: torch.Tensor, act: Activation = SWIGLU) -> torch.Tensor:
    # x: (n, D) -> (n, D); the gated activation over the fused gate/up, biases where the family has them
    if expert.w13.device != x.device:  # an expert placed on the host: compute where its weights live
        return expert_ffn(expert, x.to(expert.w13.device), act).to(x.device)
    gate_up = linear(x, expert.w13)  # (n, 2I)
    if expert.b13 is not None:
        gate_up = gate_up + expert.b13
    gate, up = gate_up.chunk(2, dim=-1)  # (n, I) each
    out = linear(act(gate, up), expert.w2)  # (n, D)
    return out if expert.b2 is None else out + expert.b2


def experts_forward(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: Sequence[ExpertWeights],
    act: Activation = SWIGLU,
    host_counts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted sum of each token's top-k experts. x: (T, D), weights/ids: (T, A) -> (T, D), and
    the tokens each expert got (E,) on x's device (for hot-expert residency).

    With `host_counts`, `experts[e]` is only touched for experts that received tokens, so a caller can
    hand in a lazy sequence that fetches streamed pages on demand. The counts reach the host once (a
    device synchronisation): the loop needs them to slice. Without, nothing is read back: see
    `_every_expert`, and `routes_on_device` for when that costs nothing. The weighted sum is accumulated
    in fp32 and rounded to x's dtype once, as transformers' grouped experts path does (a bf16 sum per
    expert rounded differently in about half the outputs of a bf16 model).
    """
    if not host_counts:
        return _every_expert(x, weights, ids, experts, act)
    top_k = ids.shape[1]
    flat_ids = ids.reshape(-1)  # (T * A,)
    order = torch.argsort(flat_ids, stable=True)  # (T * A,) assignments grouped by expert
    counts = expert_token_counts(flat_ids, len(experts))  # (E,)
    # each assignment's token and weight in that order, once: an expert's are a slice of them (a
    # step's decode runs ~E small experts a layer, where every op's fixed cost shows)
    tokens = order // top_k  # (T * A,)
    sorted_weights = weights.reshape(-1)[order, None].float()  # (T * A, 1)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # (T, D)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        token = tokens[start : start + n]  # (n,)
        y = expert_ffn(experts[e], x[token], act)  # (n, D)
        out.index_add_(0, token, y.float() * sorted_weights[start : start + n])
        start += n
    return out.to(x.dtype), counts


def _every_expert(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: Sequence[ExpertWeights],
    act: Activation,
) -> tuple[torch.Tensor, torch.Tensor]:
    """experts_forward without reading anything back: every expert computes every row, and a row it was
    not chosen for is weighted by an exact 0 (a select, so a non-finite output there cannot leak in).
    Per row the same fp32 terms are added in the same expert order as the sliced loop, plus zeros."""
    rows, num_experts = x.shape[0], len(experts)
    dense = torch.zeros(rows, num_experts, dtype=torch.float32, device=x.device).scatter_(1, ids, weights.float())
    chosen = torch.zeros(rows, num_experts, dtype=torch.bool, device=x.device).scatter_(1, ids, True)  # (T, E)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # (T, D)
    for e in range(num_experts):
        y = expert_ffn(experts[e], x, act).float()  # (T, D)
        out += torch.where(chosen[:, e, None], y * dense[:, e, None], 0.0)
    return out.to(x.dtype), chosen.sum(dim=0)


# A device GEMM reads its weights once whatever its rows up to about its roofline's ridge (bf16 on an
# H100/H200: ~300 rows); below this many rows an expert costs its weight bytes, so computing every row
# costs no more than the routed ones.
WEIGHT_BOUND_ROWS = 256
# the share of a layer's experts that rows must be expected to touch for every expert's read to cost at
# most twice the routed ones' (Mixtral, 2 of 8: from 3 rows on; DeepSeek-V3, 8 of 256: from 22)
TOUCHED_SHARE = 0.5


def routes_on_device(rows: int, num_experts: int, top_k: int) -> bool:
    """Whether a device may run `rows` rows' experts without reading their counts back: weight-bound rows,
    and enough of them that computing every expert reads at most twice the bytes the routed ones would
    (rows touch 1 - (1 - k/E)^rows of the experts, routed uniformly). Otherwise one synchronisation buys
    skipping the idle experts and slicing; on a host device it is free (docs/cgopipe-and-benchmarks.md)."""
    if rows > WEIGHT_BOUND_ROWS or num_experts <= 0:
        return False
    return 1 - (1 - top_k / num_experts) ** rows >= TOUCHED_SHARE


def expert_token_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) number of tokens routed to each expert. Not `bincount`: on CUDA it reads the largest
    id back to the host to size its output, a synchronisation this needs no more than once."""
    flat = ids.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
