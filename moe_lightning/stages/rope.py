"""Rotary position embeddings at each token's own position (ragged batches have no shared offset).

`rope_cos_sin` / `apply_rope`: plain RoPE over all of a head's dims, in the half-split layout (dim i
pairs with dim i + Hd/2, transformers' `rotate_half`). `Rope` adds what DeepSeek-V3 and GLM-4.5 need,
as transformers computes it: partial rotary (only the leading `rotary_dim` dims of a head rotate),
DeepSeek's interleaved layout (dim 2i pairs with dim 2i + 1), and YaRN's frequencies and attention
factor (`YarnScaling`); `yarn_softmax_scale` is the attention-scale correction DeepSeek pairs with YaRN.

Shapes: r = the rotated dims (Hd, or `rotary_dim`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from moe_lightning.yarn import YarnScaling


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    # positions: (T,) -> cos, sin: (T, Hd)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=positions.device) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, Hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, Hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (T, heads, Hd), cos/sin: (T, Hd)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def yarn_attention_factor(yarn: YarnScaling) -> float:
    """What cos and sin are multiplied by under YaRN (transformers' `attention_scaling`)."""
    if yarn.attention_factor is not None:
        return float(yarn.attention_factor)
    if yarn.mscale and yarn.mscale_all_dim:  # DeepSeek-V3: both 1.0, so exactly 1.0
        return float(yarn_get_mscale(yarn.factor, yarn.mscale) / yarn_get_mscale(yarn.factor, yarn.mscale_all_dim))
    return yarn_get_mscale(yarn.factor)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, 0.1 * mscale * ln(scale) + 1 (1 without scaling)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale(scale: float, yarn: YarnScaling | None) -> float:
    """The softmax scale of q @ k^T (e.g. qk_head_dim ** -0.5) with DeepSeek's YaRN correction: times
    yarn_get_mscale(factor, mscale_all_dim) twice, when the config has a (non-zero) mscale_all_dim.

    transformers' `yarn_apply_mscale`, which DeepseekV3Attention applies to its `scaling` at init. It
    covers the non-rotary dims too, on top of the attention factor in cos/sin. GLM-4.5's attention does
    not call it (its scale stays head_dim ** -0.5, YaRN or not): only the DeepSeek family applies this.
    """
    if yarn is None or not yarn.mscale_all_dim:
        return scale
    mscale = yarn_get_mscale(yarn.factor, yarn.mscale_all_dim)
    return scale * mscale * mscale  # in this order, as the reference rounds it


def yarn_inv_freq(theta: float, dim: int, yarn: YarnScaling) -> torch.Tensor:
    """(dim/2,) fp32 on the CPU: transformers' `_compute_yarn_parameters`, expression for expression.
    Frequencies that turn fewer than beta_slow times over the original context are interpolated (divided
    by `factor`), those that turn more than beta_fast times kept, a linear ramp in between."""

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times
        return (dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # (dim/2,)
    extrapolation_factor = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)  # (dim/2,)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (yarn.factor * pos_freqs)
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


@dataclass(frozen=True, slots=True)
class Rope:
    """RoPE over the leading `rotary_dim` dims of each head; a head's other dims pass through.

    `interleaved` (DeepSeek-V3's rope_interleave): the rotated dims pair up as (0, 1), (2, 3), ... and
    come out de-interleaved, [rotated evens, rotated odds], as transformers'
    `apply_rotary_pos_emb_interleave` returns them. Queries and keys come out permuted alike, so q . k
    is that of the interleaved rotation; keys cached after `apply` stay in that layout.
    Otherwise the half-split layout (dim i with dim i + r/2), as `apply_rope`.
    """

    theta: float
    rotary_dim: int  # r: all of Hd, or int(Hd * partial_rotary_factor) (GLM-4.5: Hd / 2)
    interleaved: bool = False
    yarn: YarnScaling | None = None

    def __post_init__(self) -> None:
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be positive and even, got {self.rotary_dim}")
        if not self.theta > 0:
            raise ValueError(f"theta must be positive, got {self.theta}")

    @property
    def attention_factor(self) -> float:
        """cos and sin are multiplied by this (YaRN's; 1 without YaRN)."""
        return 1.0 if self.yarn is None else yarn_attention_factor(self.yarn)

    def inv_freq(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """(r/2,) fp32. Computed on the CPU, as the reference computes its buffer before the model moves
        to a device (a GPU's pow may round differently), and kept per device: no copy per call."""
        return _inv_freq(self, torch.device(device))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) -> cos, sin: (T, r) in `dtype`, each angle twice ([freqs, freqs], the
        reference's layout for both `apply` layouts). Computed in fp32, times the attention factor,
        then cast, as transformers' rotary embedding (whose dtype is the hidden states')."""
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]  # (T, r/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, r)
        cos, sin = emb.cos(), emb.sin()
        factor = self.attention_factor
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        return cos.to(dtype), sin.to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (T, ..., Hd) with Hd >= r (e.g. (T, H, Hd), or MLA's one shared key (T, R)), cos/sin:
        (T, r) from `cos_sin` -> x's shape, dims r.. unchanged. Computed in x's dtype, as the reference."""
        r = self.rotary_dim
        shape = (x.shape[0], *([1] * (x.dim() - 2)), r)  # broadcast over the dims between T and Hd
        cos, sin = cos.reshape(shape), sin.reshape(shape)
        rot = x[..., :r]
        if self.interleaved:
            cos, sin = cos[..., : r // 2], sin[..., : r // 2]  # one angle per pair
            even, odd = rot[..., 0::2], rot[..., 1::2]  # (..., r/2) each
            out = torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
        else:
            half = r // 2
            out = rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin
        if r == x.shape[-1]:
            return out
        return torch.cat([out, x[..., r:]], dim=-1)


@lru_cache(maxsize=64)
def _inv_freq(rope: Rope, device: torch.device) -> torch.Tensor:
    # (r/2,) fp32 on `device`; one copy per (rope, device) for the process's life
    r = rope.rotary_dim
    if rope.yarn is None:  # transformers' default rope parameters
        inv_freq = 1.0 / (rope.theta ** (torch.arange(0, r, 2, dtype=torch.float) / r))
    else:
        inv_freq = yarn_inv_freq(rope.theta, r, rope.yarn)
    return inv_freq.to(device)
