"""Expert pages as calibration sees them: their bytes and format read off the weights (a tensor, or a
QuantizedLinear's parts), and random ones to measure on."""

from __future__ import annotations

import torch

from moe_lightning.hrm.layercost import NO_QUANT
from moe_lightning.quant.rtn import quantize
from moe_lightning.quant.scheme import QuantScheme, scheme_of
from moe_lightning.weights import ExpertWeights


def random_experts(
    device: torch.device, dtype: torch.dtype, hidden: int, inter: int, experts: int, quant: QuantScheme = NO_QUANT
) -> list[ExpertWeights]:
    """Experts of random weights in the model dtype, or quantized to `quant` (round to nearest)."""
    out = []
    for _ in range(experts):
        w13 = torch.randn(2 * inter, hidden, device=device, dtype=dtype) * 0.02
        w2 = torch.randn(hidden, inter, device=device, dtype=dtype) * 0.02
        if quant.quantized:
            w13, w2 = quantize(w13, quant), quantize(w2, quant)
        out.append(ExpertWeights(w13, w2))
    return out


def page_nbytes(expert: ExpertWeights) -> int:
    """Bytes of an expert's page as stored: its tensors, or a quantized linear's parts."""
    total = 0
    for t in expert.tensors():
        parts = [t] if isinstance(t, torch.Tensor) else list(t.tensors())
        total += sum(p.numel() * p.element_size() for p in parts)
    return total


def page_scheme(expert: ExpertWeights) -> QuantScheme:
    """The format of an expert's pages, read off the weights themselves (as the arena reads it off
    its pages: `quant.scheme.scheme_of`)."""
    w13, w2 = expert.w13, expert.w2
    if isinstance(w13, torch.Tensor) or isinstance(w2, torch.Tensor):
        return NO_QUANT
    groups = (w13.in_features // w13.group_size, w2.in_features // w2.group_size)
    return scheme_of(w13.format, (w13.in_features, w2.in_features), groups, w13.perm is not None)
