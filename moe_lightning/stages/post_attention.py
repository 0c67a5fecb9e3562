"""Post-attention stage: o_proj, residual, RMSNorm (`attention_output`), then router, experts (or a
dense layer's MLP), residual (`ffn`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moe_lightning.spec import ModelSpec
from moe_lightning.stages.grouped_routing import route_grouped
from moe_lightning.stages.linear import linear
from moe_lightning.stages.mla import mla_output, mla_shape
from moe_lightning.stages.moe import activation_of, expert_ffn, experts_forward, route, route_topk_softmax
from moe_lightning.stages.norm import norm
from moe_lightning.weights import ExpertWeights, LayerWeights

Reduce = Callable[[torch.Tensor], torch.Tensor]  # sums a partial result over tensor-parallel ranks


def _alone(t: torch.Tensor) -> torch.Tensor:
    return t


def attention_output(
    spec: ModelSpec, layer: LayerWeights, residual: torch.Tensor, attn_out: torch.Tensor, reduce: Reduce = _alone
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual: (T, D), attn_out: (T, H * Hd) (MLA: (T, H * C)) -> (h, the FFN's input norm(h)), both
    (T, D): the part of the stage that is per token, so that a group of micro-batches can run its FFN
    once (`ffn`)."""
    if layer.mla is not None:  # MLA: the attended latents through each head's W_uv first
        shape = mla_shape(spec)
        attn_out = mla_output(shape, layer.mla, attn_out.view(-1, shape.heads, shape.kv_lora_rank))  # (T, H * Dv)
    out = reduce(linear(attn_out, layer.wo))  # (T, D)
    if layer.wo_bias is not None:  # after the reduce: added once, not per tensor-parallel rank
        out = out + layer.wo_bias
    h = residual + out
    return h, norm(spec, h, layer.ffn_norm)


def ffn(
    spec: ModelSpec,
    layer: LayerWeights,
    h: torch.Tensor,
    x: torch.Tensor,
    experts: Sequence[ExpertWeights] | None = None,
    reduce: Reduce = _alone,
    host_counts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h, x: (T, D) from `attention_output` -> (new residual (T, D), tokens per expert (E,)): router,
    experts (or a dense layer's MLP), residual. Every row is computed on its own, so the rows of several
    micro-batches may come in one call (gpu_expert's grouped experts: each expert read once for all).
    `host_counts=False`: every expert computes every row, nothing read back (stages/moe.py)."""
    act = activation_of(spec)
    if layer.router is None:  # a dense layer (Qwen-MoE's mlp_only_layers): no routing to count
        assert layer.mlp is not None
        return h + reduce(expert_ffn(layer.mlp, x, act)), torch.empty(0, dtype=torch.long, device=x.device)
    weights, ids = route_layer(spec, layer, x)  # (T, A) each
    routed = layer.experts if experts is None else experts
    moe, counts = experts_forward(x, weights, ids, routed, act, host_counts)  # (T, D), (E,)
    if layer.shared is not None:  # an always-on expert: scaled by a sigmoid gate (Qwen2-MoE), or as is
        shared = expert_ffn(layer.shared, x, act)  # (T, D)
        moe = moe + (shared if layer.shared_gate is None else torch.sigmoid(linear(x, layer.shared_gate)) * shared)
    return h + reduce(moe), counts


def route_layer(spec: ModelSpec, layer: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (T, D) -> the layer's routing, weights (T, A) fp32 and expert ids (T, A), by the family's router."""
    assert layer.router is not None
    if spec.router_score == "sigmoid":  # DeepSeek-V3, GLM-4.5
        assert layer.router_bias is not None
        return route_grouped(
            x,
            layer.router,
            layer.router_bias,
            spec.top_k,
            spec.n_group,
            spec.topk_group,
            spec.norm_topk_prob,
            spec.routed_scaling_factor,
        )
    if spec.router_score == "softmax_topk":  # GPT-OSS
        assert layer.router_bias is not None
        return route_topk_softmax(x, layer.router, layer.router_bias, spec.top_k)
    return route(x, layer.router, spec.top_k, spec.norm_topk_prob, spec.topk_norm_p)


def post_attention(
    spec: ModelSpec,
    layer: LayerWeights,
    residual: torch.Tensor,
    attn_out: torch.Tensor,
    experts: Sequence[ExpertWeights] | None = None,
    reduce: Reduce = _alone,
    host_counts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual: (T, D), attn_out: (T, H * Hd) -> (new residual (T, D), tokens per expert (E,)).

    `experts` overrides `layer.experts` (streamed or remote experts); the counts are returned so
    the caller can count routing for hot-expert residency; a dense layer returns (0,) counts.
    On a tensor-parallel rank (moe_lightning/tensor_parallel.py) o_proj and the FFNs give partial
    sums: `reduce` adds them up over the ranks, once after attention and once after the FFNs.
    """
    h, x = attention_output(spec, layer, residual, attn_out, reduce)
    return ffn(spec, layer, h, x, experts, reduce, host_counts)
