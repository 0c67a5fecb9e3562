"""y = x @ W^T, in whichever operand order the backend runs faster; quantized W by its kernels.

CPU BLAS (oneDNN/MKL in torch) is slow for x @ W^T when x has few rows: on the 2-core dev VM an
expert FFN with 4-64 tokens ran ~2x faster as the weight-major product W @ x^T (same FLOPs, the
weight streamed once in its stored row-major order). From ~128 rows on both orders are alike, and
GPUs do not need the trick. The result is a transposed view; callers treat it as any (n, out) tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moe_lightning.quant.linear import QuantizedLinear

WEIGHT_MAJOR_BELOW = 128  # rows of x under which the weight-major order wins on CPU


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: (n, in), weight: (out, in) -> (n, out)."""
    if x.device.type == "cpu" and x.shape[0] < WEIGHT_MAJOR_BELOW:
        return (weight @ x.T).T
    return x @ weight.T


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedLinear) -> torch.Tensor:
    """x: (n, in), weight: (out, in) dense or quantized (an expert page) -> (n, out)."""
    if isinstance(weight, torch.Tensor):
        return dense_linear(x, weight)
    return weight.matmul(x)
