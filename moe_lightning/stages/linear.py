"""y = x @ W^T for a dense or a quantized W, by its kernels (quant/kernels.py)."""

from __future__ import annotations

import torch

from moe_lightning.quant.kernels import QuantizedLinear, dense_linear, quantized_linear


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedLinear) -> torch.Tensor:
    """x: (n, in), weight: (out, in) dense or quantized (an expert page) -> (n, out)."""
    if isinstance(weight, torch.Tensor):
        return dense_linear(x, weight)
    return quantized_linear(x, weight)
