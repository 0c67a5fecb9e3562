"""DeepSeek-V3's multi-head latent attention (MLA) over a paged latent cache.

A token caches one latent row per layer, C + R values: its RMS-normed compressed KV and its rotated
rope key, shared by every head. The heads' keys and values are never formed, neither for the cache
nor in attention: the absorbed projections move W_uk onto the query (q_nope @ W_uk, a query in the
latent space) and W_uv past attention (per head, the attended latent @ W_uv^T). Attention is then MQA
with one "KV head" whose keys are the whole latent row and whose values are its first C columns, so
the cache is a one-head paged cache, (NB, BS, 1, C + R), planned and addressed by stages/attention.py
(AttentionMetadata, plan_attention: block tables, slot mapping, masks, decode groups) as is.

Shape letters beyond the legend in stages/__init__.py:

    Cq   q_lora_rank (the query's low-rank bottleneck)
    C    kv_lora_rank (the compressed KV: the latent's value part)
    N    qk_nope_head_dim (a head's query/key dims without position)
    R    qk_rope_head_dim (the decoupled rotary dims, one key for all heads)
    Dv   v_head_dim
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_lightning.spec import ModelSpec
from moe_lightning.stages.attention import CHUNK_BYTES, DEVICE_CHUNK_BYTES, AttentionPlan, _blocks_of, _gather
from moe_lightning.stages.linear import linear
from moe_lightning.stages.norm import rms_norm
from moe_lightning.stages.rope import yarn_softmax_scale
from moe_lightning.weights import MlaWeights

# (x (T, heads, R), cos (T, R), sin (T, R)) -> x rotated: rope_interleaved (DeepSeek-V3's
# rope_interleave=True) or stages/rope.apply_rope (rope_interleave=False)
RopeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class MlaShape:
    heads: int  # H
    q_lora_rank: int | None  # Cq; None: one full-rank q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int  # C
    qk_nope_head_dim: int  # N
    qk_rope_head_dim: int  # R
    v_head_dim: int  # Dv
    rms_norm_eps: float  # of q_a_layernorm and kv_a_layernorm: transformers builds both with 1e-6, whatever the config
    softmax_scale: float  # (N + R) ** -0.5, times YaRN's mscale(mscale_all_dim) twice (rope.yarn_softmax_scale)

    @property
    def latent_dim(self) -> int:
        """C + R: the values one token caches per layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@functools.cache
def mla_shape(spec: ModelSpec) -> MlaShape:
    """The MLA shape of a spec (attention "mla"), its softmax scale with the YaRN correction."""
    scale = yarn_softmax_scale((spec.qk_nope_head_dim + spec.qk_rope_head_dim) ** -0.5, spec.yarn)
    return MlaShape(
        spec.num_heads,
        spec.q_lora_rank,
        spec.kv_lora_rank,
        spec.qk_nope_head_dim,
        spec.qk_rope_head_dim,
        spec.v_head_dim,
        1e-6,  # transformers builds q_a_layernorm and kv_a_layernorm with this eps, whatever the config's
        scale,
    )


def split_kv_b_proj(kv_b_proj: torch.Tensor, heads: int, qk_nope_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj: (H * (N + Dv), C), per head its N key rows then its Dv value rows -> w_uk (H, N, C),
    w_uv (H, Dv, C), each contiguous (a batched GEMM reads them per head)."""
    per_head = kv_b_proj.view(heads, -1, kv_b_proj.shape[-1])  # (H, N + Dv, C)
    return per_head[:, :qk_nope_head_dim].contiguous(), per_head[:, qk_nope_head_dim:].contiguous()


def mla_weights_from_hf(shape: MlaShape, tensors: Mapping[str, torch.Tensor]) -> MlaWeights:
    """One layer's weights from their names in a checkpoint under `model.layers.{i}.self_attn.` (the
    prefix taken off): `q_a_proj.weight`, ..., `kv_b_proj.weight` (split here); `o_proj.weight` is the
    layer's `wo`."""
    w_uk, w_uv = split_kv_b_proj(tensors["kv_b_proj.weight"], shape.heads, shape.qk_nope_head_dim)
    lora = shape.q_lora_rank is not None
    return MlaWeights(
        kv_a_proj_with_mqa=tensors["kv_a_proj_with_mqa.weight"],
        kv_a_layernorm=tensors["kv_a_layernorm.weight"],
        w_uk=w_uk,
        w_uv=w_uv,
        q_a_proj=tensors["q_a_proj.weight"] if lora else None,
        q_a_layernorm=tensors["q_a_layernorm.weight"] if lora else None,
        q_b_proj=tensors["q_b_proj.weight"] if lora else None,
        q_proj=None if lora else tensors["q_proj.weight"],
    )


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, R) whose rotary pairs are interleaved, (x0, x1), (x2, x3), ...; cos/sin: (T, R) laid out
    as cat(freqs, freqs). Returns the rotated pairs de-interleaved, (x0', x2', ..., x1', x3', ...), as
    transformers' apply_rotary_pos_emb_interleave does (bit for bit): q and k come out permuted alike, so
    their dot products are those of the interleaved rotation."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]  # (T, 1, R/2): one angle per pair
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def mla_pre_attention(
    shape: MlaShape,
    w: MlaWeights,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotate: RopeFn = rope_interleaved,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (T, D) the attention norm's output, cos/sin: (T, R) at each token's position (YaRN's attention
    factor folded in) -> q (T, H, C + R) absorbed queries, latent (T, C + R) the rows to cache."""
    t = x.shape[0]
    n, r, c = shape.qk_nope_head_dim, shape.qk_rope_head_dim, shape.kv_lora_rank
    if w.q_proj is not None:
        q = linear(x, w.q_proj)  # (T, H * (N + R))
    else:
        assert w.q_a_proj is not None and w.q_a_layernorm is not None and w.q_b_proj is not None
        q_a = rms_norm(linear(x, w.q_a_proj), w.q_a_layernorm, shape.rms_norm_eps)  # (T, Cq)
        q = linear(q_a, w.q_b_proj)  # (T, H * (N + R))
    q_nope, q_pe = q.view(t, shape.heads, n + r).split([n, r], dim=-1)  # (T, H, N), (T, H, R)
    c_kv, k_pe = linear(x, w.kv_a_proj_with_mqa).split([c, r], dim=-1)  # (T, C), (T, R)
    # normed before caching (the reference caches it so, and expands it through kv_b_proj after); the rope key is not
    c_kv = rms_norm(c_kv, w.kv_a_layernorm, shape.rms_norm_eps)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # the reference rotates in the activations' dtype
    k_pe = rotate(k_pe[:, None, :], cos, sin)[:, 0]  # (T, R)
    q_pe = rotate(q_pe, cos, sin)  # (T, H, R)
    # q_nope . (W_uk c) = (q_nope W_uk) . c: a head's nope score against the latent itself
    q_abs = torch.bmm(q_nope.transpose(0, 1), w.w_uk).transpose(0, 1)  # (H, T, N) @ (H, N, C) -> (T, H, C)
    return torch.cat([q_abs, q_pe], dim=-1), torch.cat([c_kv, k_pe], dim=-1)


def write_latent(cache: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor) -> None:
    """Appends new latent rows, rounded to the cache's dtype. cache: (NB, BS, 1, C + R); latent: (T, C + R);
    slots: (T,), `plan.write_slots` (write_kv would do too, given the cache twice, but would write it twice)."""
    cache.view(-1, cache.shape[-1])[slots] = latent.to(cache.dtype)


def mla_paged_attention(
    q: torch.Tensor, cache: torch.Tensor, plan: AttentionPlan, softmax_scale: float, kv_lora_rank: int
) -> torch.Tensor:
    """Causal MLA over cached latents. q: (T, H, C + R) from `mla_pre_attention`, cache: (NB, BS, 1, C + R)
    -> (T, H, C) in q's dtype, for `mla_output`.

    The new tokens' latents must already be in the cache (`write_latent` with `plan.write_slots`). All H
    heads attend the one latent head, so each block is read once for all of them. Dtypes as paged_attention:
    q and cache in one dtype run sdpa's fused kernel in it (fp32 softmax inside); otherwise the gathered
    chunk is upcast and attended in fp32.
    """
    fused = q.dtype == cache.dtype and (q.dtype != torch.float16 or q.device.type != "cpu")
    work = (q if fused else q.float()).contiguous()
    out = (_decode if plan.decode_groups else _prefill)(work, cache, plan, softmax_scale, kv_lora_rank)
    return out.to(q.dtype)


# V is the whole latent row, not its first C columns: with V as wide as K sdpa runs its fused kernel (a
# narrower V takes the unfused math path, 2-4x slower for a prefill on a CPU and 4-10x for a decode), and
# output columns are independent, so the R extra ones are computed and dropped.


def _decode(q: torch.Tensor, cache: torch.Tensor, plan: AttentionPlan, scale: float, c: int) -> torch.Tensor:
    """One query per sequence; its H heads are attended as H queries of the one latent head."""
    t, h, d = q.shape
    bs = cache.shape[1]
    budget = CHUNK_BYTES.get(q.device.type, DEVICE_CHUNK_BYTES)
    per_block = bs * d * q.element_size()  # one latent block as attention reads it: keys and values at once
    groups = plan.decode_groups
    chunks = [min(g.blocks.shape[0], max(1, budget // (per_block * g.blocks.shape[1]))) for g in groups]
    max_blocks = max(n * g.blocks.shape[1] for n, g in zip(chunks, groups, strict=True))
    gather = _gather("latent", cache, max_blocks, q.dtype)
    out = torch.empty(t, h, c, dtype=q.dtype, device=q.device)
    qg = q.view(t, 1, h, d)  # (T, 1, H, C + R)
    for g, chunk in zip(groups, chunks, strict=True):
        for s in range(0, g.blocks.shape[0], chunk):
            rows, blocks = g.rows[s : s + chunk], g.blocks[s : s + chunk].reshape(-1)
            n, span = rows.numel(), max(g.spans[s : s + chunk])
            latent = gather(blocks, n, span).transpose(1, 2)  # (n, 1, Lg, C + R)
            mask = g.mask[s : s + chunk, ..., :span]  # (n, 1, 1, Lg): every head of a row alike
            o = F.scaled_dot_product_attention(qg[rows], latent, latent, attn_mask=mask, scale=scale)  # (n, 1, H, C+R)
            out[rows] = o[:, 0, :, :c]
    return out


def _prefill(q: torch.Tensor, cache: torch.Tensor, plan: AttentionPlan, scale: float, c: int) -> torch.Tensor:
    """A sequence at a time: its context's blocks gathered (upcast) once, all its new tokens and heads attend."""
    t, h, d = q.shape
    out = torch.empty(t, h, c, dtype=q.dtype, device=q.device)
    start = 0
    for seq, q_len in zip(plan.sequences, plan.meta.q_lens, strict=True):
        span = seq.mask.shape[-1]
        latent = _blocks_of(cache, seq.blocks, q.dtype).view(-1, d)[:span]  # (L, C + R)
        kv = latent[None, None].expand(1, h, span, d)  # a stride-0 view over the heads: never copied per head
        qb = q[start : start + q_len].transpose(0, 1)[None]  # (1, H, q_len, C + R)
        o = F.scaled_dot_product_attention(qb, kv, kv, attn_mask=seq.mask, scale=scale)  # (1, H, q_len, C + R)
        out[start : start + q_len] = o[0, :, :, :c].transpose(0, 1)  # (q_len, H, C)
        start += q_len
    return out


def mla_output(shape: MlaShape, w: MlaWeights, attn: torch.Tensor) -> torch.Tensor:
    """attn: (T, H, C) from `mla_paged_attention` -> (T, H * Dv): each head's attended latent through its
    W_uv (the values the reference expands before attention, applied after it), ready for o_proj."""
    t = attn.shape[0]
    out = torch.bmm(attn.transpose(0, 1), w.w_uv.transpose(1, 2))  # (H, T, C) @ (H, C, Dv) -> (H, T, Dv)
    return out.transpose(0, 1).reshape(t, shape.heads * shape.v_head_dim)
