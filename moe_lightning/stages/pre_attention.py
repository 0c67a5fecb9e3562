"""Pre-attention stage: (embedding,) RMSNorm, fused QKV projection, RoPE."""

from __future__ import annotations

import functools

import torch

from moe_lightning.spec import ModelSpec
from moe_lightning.stages.linear import linear
from moe_lightning.stages.mla import mla_pre_attention, mla_shape
from moe_lightning.stages.norm import norm, rms_norm
from moe_lightning.stages.rope import Rope
from moe_lightning.weights import LayerWeights
from moe_lightning.yarn import YarnScaling


def embed_tokens(embed: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    # embed: (V, D), token_ids: (T,) -> (T, D)
    return embed[token_ids]


def pre_attention(
    spec: ModelSpec, layer: LayerWeights, hidden: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden: (T, D) residual stream, positions: (T,) -> q (T, H, Hd), k (T, K, Hd), v (T, K, Hd).

    With MLA (K = 1, Hd = C + R): q is the absorbed query and k = v the latent row the cache keeps
    (stages/mla.py), which attention reads as both."""
    t = hidden.shape[0]
    x = norm(spec, hidden, layer.attn_norm)  # (T, D)
    if spec.attention == "mla":
        assert layer.mla is not None
        rope = spec_rope(spec)
        cos, sin = rope.cos_sin(positions, hidden.dtype)  # (T, R)
        q, latent = mla_pre_attention(mla_shape(spec), layer.mla, x, cos, sin, rope.apply)
        k = latent[:, None, :]  # (T, 1, C + R)
        return q, k, k
    assert layer.wqkv is not None
    qkv = linear(x, layer.wqkv)  # (T, (H + 2K) * Hd)
    if layer.wqkv_bias is not None:
        qkv = qkv + layer.wqkv_bias
    q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    if spec.qk_norm == "full":  # OLMoE: over the whole projection, before the head split
        q = rms_norm(q, layer.q_norm, spec.rms_norm_eps)  # (T, H * Hd)
        k = rms_norm(k, layer.k_norm, spec.rms_norm_eps)  # (T, K * Hd)
    if spec.clip_qkv is not None:
        c = spec.clip_qkv
        q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
    q = q.reshape(t, spec.num_heads, spec.head_dim)  # (T, H, Hd)
    k = k.reshape(t, spec.num_kv_heads, spec.head_dim)  # (T, K, Hd)
    v = v.reshape(t, spec.num_kv_heads, spec.head_dim)  # (T, K, Hd)
    if spec.qk_norm == "head":  # Qwen3: per head, over Hd
        q = rms_norm(q, layer.q_norm, spec.rms_norm_eps)
        k = rms_norm(k, layer.k_norm, spec.rms_norm_eps)
    # partial rotary (GLM-4.5) rotates the leading dims of each head; YaRN (GPT-OSS) scales the frequencies
    rope = spec_rope(spec)
    cos, sin = rope.cos_sin(positions, hidden.dtype)  # (T, r)
    return rope.apply(q, cos, sin), rope.apply(k, cos, sin), v.contiguous()


def spec_rope(spec: ModelSpec) -> Rope:
    """The spec's RoPE (its rotated dims: R with MLA), with its layout and YaRN scaling."""
    dims = spec.qk_rope_head_dim if spec.attention == "mla" else spec.rope_dim
    return _rope(spec.rope_theta, dims, spec.rope_interleave, spec.yarn)


@functools.cache
def _rope(theta: float, dims: int, interleave: bool, yarn: YarnScaling | None) -> Rope:
    # by its fields, not the spec: a spec built with a list in it (eos_token_ids) is unhashable
    return Rope(theta, dims, interleave, yarn)
