"""Quantized weights are expanded a block of rows at a time, never whole (issue 53, item 1): on CUDA
`dequant_mm` dequantized a whole linear, an fp32 copy of it and the scaled product, 7.4 GB for
DeepSeek-V3's int8 LM head at start. Blocks hold at most scheme.dequant_chunk weights (64 Mi on
CUDA: 256 MiB of fp32), and every blocked path gives the bits of one expansion of the whole weight:
dequantization, quantization (rtn, `--quantize-dense`) and dequantize-then-GEMM."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from moe_lightning.quant import kernels
from moe_lightning.quant import scheme as quant_scheme
from moe_lightning.quant.dense import quantize_rows
from moe_lightning.quant.kernels import QuantizedLinear, dense_linear
from moe_lightning.quant.rtn import quantize
from moe_lightning.quant.scheme import DEVICE_FP32_BLOCK_BYTES, QuantFormat, QuantScheme

FORMATS = [QuantScheme(QuantFormat.INT8), QuantScheme(QuantFormat.INT4, 32), QuantScheme(QuantFormat.MXFP4)]
T = TypeVar("T")
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit: -0.0 is not 0.0, and a NaN equals the same NaN."""
    return a.dtype == b.dtype and torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


def page(scheme: QuantScheme, n: int = 96, k: int = 256, seed: int = 0, extreme: bool = True) -> QuantizedLinear:
    if scheme.format is QuantFormat.MXFP4:  # raw bytes; `extreme`: every e8m0 scale (subnormals, infs)
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen(seed))
        lo, hi = (0, 256) if extreme else (100, 140)
        s = torch.randint(lo, hi, (n, k // 32), dtype=torch.uint8, generator=gen(seed + 1))
        return QuantizedLinear(QuantFormat.MXFP4, q, s)
    return quantize(torch.randn(n, k, generator=gen(seed)) * torch.logspace(-4, 2, n)[:, None], scheme)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scheme", FORMATS, ids=lambda s: s.key())
def test_blocked_dequantization_is_one_dequantization_bit_for_bit(scheme: QuantScheme, dtype: torch.dtype) -> None:
    ql = page(scheme)
    whole = kernels._dequantize_rows(ql, dtype)
    for rows in (1, 10, 95, 96):  # 10: nine blocks and a short one
        assert same_bits(kernels.dequantize(ql, dtype, rows=rows), whole), rows


def test_blocked_dequantization_keeps_the_activation_order() -> None:
    """An act-order int4 page (GPTQ desc_act): blocks of rows, then each part's columns put back."""
    ql = page(QuantScheme(QuantFormat.INT4, 32, act_order=True))
    ql.perm = torch.stack([torch.randperm(256, generator=gen(s)) for s in (1, 2)]).to(torch.int32)
    whole = kernels.dequantize(ql, torch.float32, rows=96)
    assert same_bits(kernels.dequantize(ql, torch.float32, rows=7), whole)
    for p in range(2):
        rows = whole[p * 48 : (p + 1) * 48]
        assert same_bits(rows[:, ql.perm[p].long()], kernels._dequantize_rows(ql, torch.float32)[p * 48 : (p + 1) * 48])


@pytest.mark.parametrize("scheme", FORMATS, ids=lambda s: s.key())
def test_dequant_mm_in_blocks_is_the_row_sliced_gemm(scheme: QuantScheme) -> None:
    """Each block's columns are the dense GEMM on that block's dequantization, bit for bit (300 rows of
    x: past the CPU's dense race, one BLAS call per shape)."""
    ql = page(scheme, extreme=False)
    x = torch.randn(300, 256, generator=gen(5))
    got = kernels._dequant_mm_blocks(x, ql, 10)
    want = torch.cat(
        [dense_linear(x, kernels._dequantize_rows(ql.rows(s, s + 10), x.dtype)) for s in range(0, 96, 10)], 1
    )
    assert same_bits(got, want)
    # against one GEMM over every row: BLAS sums in another order (on AMD EPYC, 0.0017 off at outputs of
    # ~5,000 where they cancel), so the bound is fp32 round-off of the outputs' scale, not of each output
    whole = x @ kernels.dequantize(ql).T
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5 * whole.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scheme", FORMATS, ids=lambda s: s.key())
def test_quantization_in_blocks_is_one_quantization_bit_for_bit(scheme: QuantScheme, dtype: torch.dtype) -> None:
    w = (torch.randn(96, 256, generator=gen(3)) * torch.logspace(-4, 2, 96)[:, None]).to(dtype)
    w[3] = 0.0
    w[4] = -0.0
    before = w.clone()
    whole = quantize(w, scheme, rows=96)
    for rows in (1, 10, 95):
        part = quantize(w, scheme, rows=rows)
        assert all(
            torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(part.tensors(), whole.tensors(), strict=True)
        )
    assert torch.equal(w, before)  # divided in place, but in a copy of its own


def test_quantize_dense_takes_the_devices_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(1000, 64, dtype=torch.bfloat16, generator=gen(4))
    whole = quantize(w, QuantScheme(QuantFormat.INT8), rows=1000)
    monkeypatch.setattr(quant_scheme, "DEQUANT_CHUNK", 96 * 64)  # the CPU's block: 96 rows, 11 blocks
    by_device = quantize_rows(w, QuantScheme(QuantFormat.INT8))
    assert torch.equal(by_device.qweight, whole.qweight) and torch.equal(by_device.scales, whole.scales)


# --- CUDA: the peak of a vocabulary-sized int8 head -----------------------------------------------
HEAD = (131072, 4096)  # 512 Mi weights: 2 GiB in fp32, 1 GiB in bf16
SLACK = 64 << 20  # cuBLAS's workspace, the output (2 MiB) and the allocator's rounding


def _head(device: torch.device) -> QuantizedLinear:
    g = torch.Generator(device=device).manual_seed(0)
    n, k = HEAD
    qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device, generator=g)
    scales = torch.rand(n, device=device, generator=g) * 1e-3 + 1e-5
    return QuantizedLinear(QuantFormat.INT8, qweight, scales)


def _growth(device: torch.device, run: Callable[[], T]) -> tuple[T, int]:
    """run()'s result and the most device memory it held at once beyond what was allocated before."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = run()
    torch.cuda.synchronize(device)
    return out, torch.cuda.max_memory_allocated(device) - base


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_dequant_mm_of_an_int8_head_peaks_at_one_block() -> None:
    """One block's fp32 copy (256 MiB) and its bf16 rounding (128 MiB) at a time: 384 MiB + slack,
    where the whole head at once took 4 GiB (its fp32 copy and the scaled product)."""
    device = torch.device("cuda")
    ql = _head(device)
    n, k = HEAD
    x = torch.randn(8, k, device=device, generator=torch.Generator(device=device).manual_seed(1)).to(torch.bfloat16)
    rows = kernels.dequant_block_rows(n, k, "cuda")
    assert rows == 16384 and rows * k * 4 == DEVICE_FP32_BLOCK_BYTES  # 8 blocks
    kernels._dequant_mm(x, ql.rows(0, rows))  # cuBLAS's handle and workspace exist before the measurement
    got, growth = _growth(device, lambda: kernels._dequant_mm(x, ql))
    bound = rows * k * (4 + 2) + SLACK  # 448 MiB
    assert growth <= bound, f"dequant_mm grew the device's memory by {growth / 2**20:.0f} MiB"
    assert growth < n * k * 4 // 4  # under a quarter of the head's fp32 size
    want = torch.cat([x @ kernels._dequantize_rows(ql.rows(s, s + rows), x.dtype).T for s in range(0, n, rows)], 1)
    assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_quantize_dense_of_a_bf16_head_peaks_at_one_block() -> None:
    """--quantize-dense int8 at start: the int8 result (512 MiB) and its scales, and one block's fp32
    copy and int8 part (320 MiB), not the whole head's fp32 (2 GiB) nor the parts twice (a cat)."""
    device = torch.device("cuda")
    n, k = HEAD
    w = torch.randn(n, k, device=device, generator=torch.Generator(device=device).manual_seed(2)).to(torch.bfloat16)
    got, growth = _growth(device, lambda: quantize_rows(w, QuantScheme(QuantFormat.INT8)))
    block = DEVICE_FP32_BLOCK_BYTES // 4
    bound = n * k + n * 4 + block * (4 + 1) + SLACK
    assert growth <= bound, f"quantize_rows grew the device's memory by {growth / 2**20:.0f} MiB"
    want = quantize(w, QuantScheme(QuantFormat.INT8), rows=4096)
    assert torch.equal(got.qweight, want.qweight) and torch.equal(got.scales, want.scales)
