"""Round-to-nearest quantization of a weight matrix into our formats (what `--quantize` does at load;
mxfp4 the OCP MX way, quant/mxfp4.py)."""

from __future__ import annotations

import torch

from moe_lightning.quant.kernels import QuantizedLinear
from moe_lightning.quant.mxfp4 import quantize_mxfp4
from moe_lightning.quant.scheme import QuantFormat, QuantScheme


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values in [0, 15] -> (N, K/2) uint8, column 2j in the high nibble."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] << 4) | q[:, 1::2]


def quantize(w: torch.Tensor, scheme: QuantScheme) -> QuantizedLinear:
    """w: (N, K) in any float dtype -> its quantized form (computed in float32, on w's device)."""
    w = w.float()
    n, k = w.shape
    if scheme.format is QuantFormat.INT8:
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # (N,)
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return QuantizedLinear(QuantFormat.INT8, q.contiguous(), scales.contiguous())
    if scheme.format is QuantFormat.INT4:
        groups = scheme.groups(k)
        wg = w.view(n, groups, k // groups)  # (N, K/G, G)
        lo = wg.amin(dim=-1).clamp(max=0)  # the range always holds 0, so zero weights stay exact
        hi = wg.amax(dim=-1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)  # (N, K/G)
        zero_int = torch.round(-lo / scales).clamp(0, 15)
        q = (torch.round(wg / scales[..., None]) + zero_int[..., None]).clamp(0, 15).view(n, k)
        zeros = scales * (8 - zero_int)  # w = (q - zero_int) * s = (q - 8) * s + zeros
        return QuantizedLinear(QuantFormat.INT4, pack_int4(q).contiguous(), scales.contiguous(), zeros.contiguous())
    if scheme.format is QuantFormat.MXFP4:  # OCP MX round to nearest, power-of-two scale per 32
        return QuantizedLinear(QuantFormat.MXFP4, *quantize_mxfp4(w))
    raise ValueError("nothing to quantize for format none")
