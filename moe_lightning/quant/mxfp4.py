"""MXFP4 (OCP Microscaling, as GPT-OSS publishes its experts): 4-bit e2m1 values, two per byte, and
one e8m0 scale (a power of two, exponent bias 127) per block of 32 input values.

A weight (N, K) is two pages (scheme.py):

    qweight  uint8 (N, K/2): byte j of a row holds input column 2j in its LOW nibble and 2j+1 in
             its high one (the order of the published `*_blocks` and of transformers'
             convert_moe_packed_tensors); a checkpoint's blocks (N, K/32, 16) are this with a reshape
    scales   uint8 (N, K/32): e8m0, w = e2m1(nibble) * 2^(scale - 127)

Dequantization equals transformers' (`FP4_VALUES` and `torch.ldexp`) bit for bit, in any dtype:
each weight is the exact value e2m1 * 2^(scale - 127) rounded once to the dtype, so the extreme
scales do what ldexp does with them: 0 (2^-127) gives float32 subnormals, 253-255 overflow the
largest values to inf, and 255 (NaN in the OCP spec) is read as 2^128 like any other, with no NaN.
A checkpoint whose scales would do either is refused at load (`scale_problem`).
"""

from __future__ import annotations

import torch

BLOCK = 32  # input values per scale
SCALE_BIAS = 127
E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of the largest e2m1 value (6 = 1.5 * 2^2): OCP's emax_elem
# Nibble -> value: bit 3 the sign, then 2 exponent bits (bias 1) and 1 mantissa bit; transformers'
# FP4_VALUES, in its order.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Midpoints between consecutive magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (quantize_mxfp4's rounding).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# Integer carrying one pair of values (the two nibbles of a byte) per element of a given width, so a
# gather moves both at once: 2 x fp32 = int64, 2 x 16-bit = int32.
_PAIR_INT = {4: torch.int64, 2: torch.int32}
_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def e2m1_table(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """(16,) the value of each nibble."""
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def scale_table(dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu") -> torch.Tensor:
    """(256,) 2^(s - 127) for every e8m0 byte s, exact in float64 (in float32 2^-127 is a subnormal
    and 2^128 is inf)."""
    exact = torch.tensor([2.0 ** (s - SCALE_BIAS) for s in range(256)], dtype=torch.float64)
    return exact.to(dtype).to(device)


def value_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(65536, 2) in `dtype`: row (s << 8) | b holds the two weights byte b stands for under scale s
    (low nibble first). The products are formed in float64, where all are exact (two significant
    bits times 2^-127 .. 2^128), then rounded once to `dtype`, as ldexp rounds: 0.5 * 2^128 is a
    finite float32 (2^127), not 0.5 * inf; a float32 scale table would not give that. Built on the
    CPU whatever the device, so every device holds the same bits; cached per dtype and device
    (512 KiB in float32)."""
    key = (dtype, torch.device(device))
    table = _TABLES.get(key)
    if table is None:
        e2m1 = e2m1_table(torch.float64)
        byte = torch.arange(256)
        pairs = torch.stack([e2m1[byte & 15], e2m1[byte >> 4]], dim=-1)  # (256, 2)
        table = (scale_table()[:, None, None] * pairs).reshape(65536, 2).to(dtype).to(device).contiguous()
        _TABLES[key] = table
    return table


NAN_SCALE = 255  # e8m0's NaN (OCP MX)
OVERFLOW_SCALE = 253  # from here a block's largest magnitudes pass float32's range (4 * 2^126 = 2^128: inf)


def scale_problem(qweight: torch.Tensor, scales: torch.Tensor) -> str | None:
    """Why MXFP4 weights, qweight uint8 (..., N, K/2) and scales uint8 (..., N, K/32), would not
    dequantize to finite values, or None: a scale byte of 255 (NaN in e8m0), or one of 253 or 254 on a
    block whose largest values then pass float32's (and bfloat16's) range. One comparison over the
    scales; the blocks are looked at only under such a scale."""
    big = scales >= OVERFLOW_SCALE
    if not bool(big.any()):
        return None
    nan = int((scales == NAN_SCALE).sum())
    if nan:
        return f"{nan} scale(s) of {NAN_SCALE}, which is NaN in e8m0"
    blocks = qweight.reshape(*scales.shape, BLOCK // 2)[big].to(torch.int32)  # (M, 16): bytes under those scales
    idx = (scales[big].to(torch.int32).unsqueeze(-1) << 8) | blocks
    values = value_table(torch.float32, qweight.device)[idx.reshape(-1)]
    if bool(torch.isfinite(values).all()):
        return None
    return f"scales of {OVERFLOW_SCALE}-{NAN_SCALE - 1} on blocks whose values then pass float32's range (inf)"


def _check(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[int, int]:
    if qweight.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4 pages are uint8, got qweight {qweight.dtype} and scales {scales.dtype}")
    n, half = qweight.shape
    if half % (BLOCK // 2) or tuple(scales.shape) != (n, half // (BLOCK // 2)):
        raise ValueError(
            f"mxfp4 qweight {tuple(qweight.shape)} needs scales ({n}, {half // (BLOCK // 2)}) "
            f"and a width that is whole blocks of {BLOCK // 2} bytes; got scales {tuple(scales.shape)}"
        )
    return n, half // (BLOCK // 2)


def dequantize_mxfp4(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """qweight uint8 (N, K/2), scales uint8 (N, K/32) -> (N, K) in `dtype`, equal bit for bit to
    transformers' convert_moe_packed_tensors (transposed back to (N, K)).

    One gather per byte from value_table, indexed by (scale << 8) | byte: both nibbles and their
    scale at once, no shift, interleave or multiply over the (N, K) result. Indexing a 16-entry
    table by the nibbles and then scaling, as transformers does, took ~30x longer on the dev VM
    (int64 indices, two passes and a multiply over the whole weight)."""
    n, blocks = _check(qweight, scales)
    table = value_table(dtype, qweight.device)
    idx = qweight.reshape(n, blocks, BLOCK // 2).to(torch.int32)
    idx.bitwise_or_((scales.to(torch.int32) << 8).unsqueeze(-1))
    wide = _PAIR_INT.get(table.element_size())
    if wide is None:  # float64: no integer twice its width; gather the rows of two
        return table.index_select(0, idx.view(-1)).view(n, blocks * BLOCK)
    return table.view(wide).view(-1).index_select(0, idx.view(-1)).view(dtype).view(n, blocks * BLOCK)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float, K a multiple of 32 -> (qweight uint8 (N, K/2), scales uint8 (N, K/32)).

    OCP MX: each block of 32 shares the scale 2^e with e = floor(log2(max |w|)) - 2, so the block's
    largest value lands in [4, 8) and the rest on the e2m1 grid below it; values are rounded to the
    nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6 (ties to the even mantissa, as IEEE conversion) and
    saturate at 6. An all-zero block takes the smallest scale (e = -127, byte 0); e is clamped to
    [-127, 127] (byte 255 is NaN in the spec). The sign is kept, so -0.0 stays -0.0. Computed in
    float32 on w's device; a weight that is already a dequantized MXFP4 weight comes back exactly."""
    if w.dim() != 2:
        raise ValueError(f"mxfp4 quantizes an (N, K) weight, got shape {tuple(w.shape)}")
    if w.shape[1] % BLOCK:
        raise ValueError(f"mxfp4 needs an input width that is a multiple of {BLOCK}, got {w.shape[1]}")
    n, k = w.shape
    wb = w.float().reshape(n, k // BLOCK, BLOCK)
    amax = wb.abs().amax(dim=-1)  # (N, K/32)
    if not torch.isfinite(amax).all():
        raise ValueError("mxfp4 quantization needs finite weights")
    _, exp = torch.frexp(amax)  # amax = m * 2^exp, m in [0.5, 1): floor(log2(amax)) = exp - 1, exactly
    e = torch.where(amax > 0, exp - 1 - E2M1_EMAX, -SCALE_BIAS).clamp(-SCALE_BIAS, SCALE_BIAS)
    x = torch.ldexp(wb, -e.unsqueeze(-1))  # w / 2^e, exact (a power of two)
    a = x.abs()
    mids = torch.tensor(_MIDPOINTS, device=w.device)
    idx = torch.bucketize(a, mids)  # a tie lands on the lower magnitude ...
    tie = (a == mids[idx.clamp(max=len(_MIDPOINTS) - 1)]) & (idx % 2 == 1)
    idx += tie  # ... which is right when its mantissa bit is even, else it goes up
    nib = (idx | (torch.signbit(x).long() << 3)).to(torch.uint8).reshape(n, k)
    qweight = nib[:, 0::2] | (nib[:, 1::2] << 4)  # column 2j in the low nibble
    return qweight.contiguous(), (e + SCALE_BIAS).to(torch.uint8).contiguous()


def from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """A checkpoint's `*_blocks` (..., N, K/32, 16) -> qweight (..., N, K/2): the same bytes."""
    return blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1])


def to_blocks(qweight: torch.Tensor) -> torch.Tensor:
    """qweight (..., N, K/2) -> the published blocks (..., N, K/32, 16)."""
    return qweight.reshape(*qweight.shape[:-1], qweight.shape[-1] // (BLOCK // 2), BLOCK // 2)
