"""What the native host GEMM tests check, on whichever build of expert_gemm.cpp they are handed: the
one this CPU runs (test_host_kernels.py) and the builds for other CPUs' instruction sets
(test_host_kernel_variants.py)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from moe_lightning.quant.kernels import QuantizedLinear
from moe_lightning.quant.rtn import quantize
from moe_lightning.quant.scheme import QuantFormat, QuantScheme

SHAPES = [(96, 256), (37, 384), (200, 1024)]  # weight rows no multiple of the tiles' 3-4 either
GROUPS = [32, 64, 128, -1]


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def operands(n: int, k: int, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.02, torch.randn(rows, k, generator=g)


Int8Kernel = Callable[[ModuleType, torch.Tensor, QuantizedLinear], torch.Tensor]
INT8: dict[str, Int8Kernel] = {
    "int8_f32": lambda ext, x, q: ext.int8_f32(x, q.qweight, q.scales),
    "int8_i8": lambda ext, x, q: ext.int8_i8(x, q.qweight, q.scales),
}
INT4: dict[str, Int8Kernel] = {
    "int4_f32": lambda ext, x, q: ext.int4_f32(x, q.qweight, q.scales, q.zeros),
    "int4_i8": lambda ext, x, q: ext.int4_i8(x, q.qweight, q.scales, q.zeros),
}
EXACT = 1e-5  # fp32 activations: the order of the sums alone
INT8_ACTIVATIONS = 1.5e-2  # ~0.7 % of the largest output at these shapes, measured; 2x margin


def check_every_kernel(ext: ModuleType, n: int, k: int, rows: int) -> None:
    w, x = operands(n, k, rows, seed=rows)
    assert rel_error(ext.dense_f32(x, w), x @ w.T) <= EXACT
    q8 = quantize(w, QuantScheme(QuantFormat.INT8))
    want = x @ q8.dequantize().T
    for name, fn in INT8.items():
        tol = EXACT if name.endswith("f32") else INT8_ACTIVATIONS
        assert rel_error(fn(ext, x, q8), want) <= tol, (name, n, k, rows)
    for group in GROUPS:
        q4 = quantize(w, QuantScheme(QuantFormat.INT4, group))
        want = x @ q4.dequantize().T
        for name, fn in INT4.items():
            tol = EXACT if name.endswith("f32") else INT8_ACTIVATIONS
            assert rel_error(fn(ext, x, q4), want) <= tol, (name, group, n, k, rows)


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the i8 kernels see it: each (row, 128 columns) scaled by 127 / max|x|, rounded half to even
    (nearbyint's default mode), and scaled back; a block of zeros stays zeros."""
    blocks = x.reshape(x.shape[0], -1, 128)
    top = blocks.abs().amax(-1, keepdim=True)
    c127 = torch.full_like(top, 127.0)  # tensor / tensor: a scalar divisor is a multiply by its reciprocal
    inv = torch.where(top > 0, c127 / top, torch.zeros_like(top))
    scale = torch.where(top > 0, top / c127, torch.ones_like(top))
    return (torch.round(blocks * inv) * scale).reshape(x.shape)


def check_rounded_activations(ext: ModuleType) -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 4096, generator=g) * 0.02
    x = torch.randn(64, 4096, generator=g) * 3
    x[3, 128:256] = 0.0
    x[7, :5] = 0.0
    # the last 16 rows: every value x * (127 / 3) a hair from an odd k + 1/2, their blocks' max 3. Rounded
    # as the product's fp32 value (k + 1/2 exactly) they go to the even neighbour, k + 1; with the
    # multiply fused into the rounding's add, about half would go to k
    odd = torch.randint(-63, 62, (16, 4096), generator=g) * 2 + 1
    inv = torch.tensor(127.0) / torch.tensor(3.0)
    x[48:] = ((odd + 0.5).double() / inv.double()).float()
    x[48:, ::128] = 3.0
    for fmt, group, fn in ((QuantFormat.INT8, 128, INT8["int8_i8"]), (QuantFormat.INT4, 32, INT4["int4_i8"])):
        q = quantize(w, QuantScheme(fmt, group))
        want = (rounded_activations(x).double() @ q.dequantize().double().T).float()
        assert rel_error(fn(ext, x, q), want) <= 2e-6, fmt  # one activation off by one step: ~1e-4


def check_long_rows(ext: ModuleType) -> None:
    """The fp32-activation GEMMs take K in chunks of 1024 columns once x has more rows than one tile:
    each tile's sums carried across chunks, the last one ragged (K no multiple of the vectors either)."""
    for n, k in ((37, 2500), (16, 2048), (9, 1040)):
        for rows in (1, 7, 33):
            w, x = operands(n, k, rows, seed=k + rows)
            assert rel_error(ext.dense_f32(x, w), x @ w.T) <= EXACT, (n, k, rows)
            q8 = quantize(w, QuantScheme(QuantFormat.INT8))
            assert rel_error(ext.int8_f32(x, q8.qweight, q8.scales), x @ q8.dequantize().T) <= EXACT, (n, k, rows)


def check_evict_keeps_the_bytes(ext: ModuleType) -> None:
    """Eviction writes lines back and drops them: every value reads the same after it, at any dtype,
    length and start (a view that begins and ends inside a cache line)."""
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (10_000,), dtype=torch.uint8, generator=g)
    for t in (raw, raw[3:1003], torch.randn(37, 129, generator=g), torch.randn(1), raw.view(torch.int8)[:64]):
        before = t.clone()
        ext.evict(t)
        assert torch.equal(t, before)
    ext.evict(torch.empty(0))
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.evict(torch.randn(8, 8).t())


def check_argmax_columns(ext: ModuleType) -> None:
    """Each column's first maximum, as torch.argmax(dim=0) picks it: at row counts under, at and over a
    thread's run (256), with the maximum repeated in one run and across runs (the first wins), and NaN
    (the first NaN wins over any number)."""
    g = torch.Generator().manual_seed(0)
    for rows in (1, 2, 255, 256, 257, 1000, 32000):
        for cols in (1, 3, 16, 257):
            t = torch.randn(rows, cols, generator=g)
            if rows > 1:
                t[rows - 1, 0] = t[0, 0] = 100.0  # the first row and the last: different runs
            if rows > 600:
                t[500, cols - 1] = t[510, cols - 1] = 100.0  # within a run
            assert torch.equal(ext.argmax_columns(t), t.argmax(dim=0)), (rows, cols)
    t = torch.randn(1000, 4, generator=g)
    t[700, 1] = t[900, 1] = t[300, 2] = float("nan")
    t[0, 2] = float("inf")
    got = ext.argmax_columns(t)
    assert torch.equal(got, t.argmax(dim=0)) and got[1] == 700 and got[2] == 300
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.argmax_columns(torch.randn(8, 4).T)
    with pytest.raises(RuntimeError, match="R > 0"):
        ext.argmax_columns(torch.randn(0, 4))
