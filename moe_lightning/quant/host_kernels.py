"""The native host GEMMs (moe_lightning/native/expert_gemm.cpp) as candidates of the kernel chooser
(kernels.py): each takes (x, weight) and returns x @ W^T in x's dtype, or raises NotImplementedError
where the extension is not built here (no compiler, MOE_LIGHTNING_NATIVE=0, a CPU with neither AVX2 nor
AVX-512), so the chooser keeps PyTorch's kernels alone.

They read an int8 or int4 page as it lies and convert it in registers: the fp32 weight never exists
whole, as it does in dequantize-then-GEMM, and each weight byte is read once for all the rows, which is
what a GEMM at decode's 8-64 rows per expert waits on. `*_f32` keep the activations in fp32 (the GEMM on
the dequantized weights, up to the order of the sums); `*_i8` quantize them to int8 per (row, block of
128 columns) and multiply by 4-byte integer dot products (VNNI where the CPU has it).
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch

from moe_lightning import native

if TYPE_CHECKING:
    from moe_lightning.quant.kernels import QuantizedLinear


def extension() -> ModuleType | None:
    """The built extension, built on first use (logged once: `native_kernels expert_gemm=...`)."""
    return native.expert_kernel()


def available() -> bool:
    ext = extension()
    return ext is not None and ext.isa != "none"


def _ext() -> ModuleType:
    ext = extension()
    if ext is None:
        raise NotImplementedError("the native expert kernels are not built on this machine (see native_kernels)")
    return ext


def _fp32(x: torch.Tensor) -> torch.Tensor:
    return x.float().contiguous()


def evict(tensors: list[torch.Tensor]) -> bool:
    """Drops these host tensors' bytes from the CPU's caches (the next read comes from DRAM); False
    where the extension is not built here (nothing evicted)."""
    ext = extension()
    if ext is None:
        return False
    for t in tensors:
        if t.device.type == "cpu" and t.is_contiguous() and t.numel():
            ext.evict(t)
    return True


def argmax_columns(t: torch.Tensor) -> torch.Tensor | None:
    """t: contiguous (R, C) fp32 on the CPU -> each column's first maximum, (C,) int64, NaN counting as the
    maximum (torch.argmax's rule); None where the extension is not built here."""
    ext = extension()
    return None if ext is None else ext.argmax_columns(t)


def dense_native(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _ext().dense_f32(_fp32(x), w).to(x.dtype)


def int8_f32(x: torch.Tensor, ql: QuantizedLinear) -> torch.Tensor:
    return _ext().int8_f32(_fp32(x), ql.qweight, ql.scales).to(x.dtype)


def int8_i8(x: torch.Tensor, ql: QuantizedLinear) -> torch.Tensor:
    return _ext().int8_i8(_fp32(x), ql.qweight, ql.scales).to(x.dtype)


def int4_f32(x: torch.Tensor, ql: QuantizedLinear) -> torch.Tensor:
    return _ext().int4_f32(_fp32(x), ql.qweight, ql.scales, ql.zeros).to(x.dtype)


def int4_i8(x: torch.Tensor, ql: QuantizedLinear) -> torch.Tensor:
    return _ext().int4_i8(_fp32(x), ql.qweight, ql.scales, ql.zeros).to(x.dtype)
