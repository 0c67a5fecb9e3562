"""Round-to-nearest quantization of a weight matrix into our formats (what `--quantize` does at load;
mxfp4 the OCP MX way, quant/mxfp4.py)."""

from __future__ import annotations

import torch

from moe_lightning.quant.kernels import QuantizedLinear
from moe_lightning.quant.mxfp4 import quantize_mxfp4
from moe_lightning.quant.scheme import QuantFormat, QuantScheme, block_rows, dequant_chunk


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values in [0, 15] -> (N, K/2) uint8, column 2j in the high nibble."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] << 4) | q[:, 1::2]


def quantize(w: torch.Tensor, scheme: QuantScheme, rows: int | None = None) -> QuantizedLinear:
    """w: (N, K) in any float dtype -> its quantized form (computed in float32, on w's device), `rows`
    output rows at a time (default: the device's dequantization block, scheme.dequant_chunk): every
    format's scales are per row (or per part of one), so the parts simply stack, and no float32 copy
    of more than a block exists (an LM head's, quant/dense.py, would be gigabytes on the GPU)."""
    n, k = w.shape
    if rows is None:
        rows = block_rows(n, k, dequant_chunk(w.device.type))
    if rows >= n:
        return _quantize(w, scheme)
    # each part written into the whole result (a list of parts and their cat would hold it twice),
    # allocated once the first part shows the components' dtypes
    out: dict[str, torch.Tensor] = {}
    for i in range(0, n, rows):
        part = _quantize(w[i : i + rows], scheme)
        if not out:
            out = {name: t.new_empty((n, *t.shape[1:])) for name, t in part.components()}
        for name, t in part.components():
            out[name][i : i + rows] = t
        del part  # not held while the next one is made
    return QuantizedLinear(scheme.format, **out)


def _quantize(w: torch.Tensor, scheme: QuantScheme) -> QuantizedLinear:
    if scheme.format is QuantFormat.MXFP4:  # OCP MX round to nearest, power-of-two scale per 32
        return QuantizedLinear(QuantFormat.MXFP4, *quantize_mxfp4(w))
    # a float32 copy of its own, divided in place: one float32 copy of w at a time, not three
    w = w.to(torch.float32, copy=True)
    n, k = w.shape
    if scheme.format is QuantFormat.INT8:
        lo, hi = torch.aminmax(w, dim=1)  # max |w| = max(hi, -lo), exactly, with no |w| copy
        scales = (torch.maximum(hi, -lo) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # (N,)
        q = w.div_(scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        return QuantizedLinear(QuantFormat.INT8, q.contiguous(), scales.contiguous())
    if scheme.format is QuantFormat.INT4:
        groups = scheme.groups(k)
        wg = w.view(n, groups, k // groups)  # (N, K/G, G)
        lo = wg.amin(dim=-1).clamp(max=0)  # the range always holds 0, so zero weights stay exact
        hi = wg.amax(dim=-1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)  # (N, K/G)
        zero_int = torch.round(-lo / scales).clamp(0, 15)
        q = wg.div_(scales[..., None]).round_().add_(zero_int[..., None]).clamp_(0, 15).view(n, k)
        zeros = scales * (8 - zero_int)  # w = (q - zero_int) * s = (q - 8) * s + zeros
        return QuantizedLinear(QuantFormat.INT4, pack_int4(q).contiguous(), scales.contiguous(), zeros.contiguous())
    raise ValueError("nothing to quantize for format none")
