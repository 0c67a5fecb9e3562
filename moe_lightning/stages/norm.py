"""RMSNorm, computed in fp32 as the reference does, so bf16 checkpoints round the same way."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moe_lightning.spec import ModelSpec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: (T, D), weight: (D,)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def norm(spec: ModelSpec, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The decoder's own norm: RMSNorm, or LayerNorm without bias (DBRX), in fp32 like the reference."""
    if spec.norm == "layer":
        return torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), weight.float(), None, spec.rms_norm_eps).to(
            x.dtype
        )
    return rms_norm(x, weight, spec.rms_norm_eps)
