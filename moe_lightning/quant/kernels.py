"""y = x @ W^T by the kernels this project can run, the quantized W they run over (QuantizedLinear: a
layer's tensors, in the formats of scheme.py), and the entry points that run the kernel chosen for
each call (kernel_choice.py: the race at a bucket's first call, near ties settled on a CPU's calls).

Dense W (`dense_linear`) on a CPU below DENSE_RACE_BELOW rows races the operand orders of PyTorch's GEMM
(oneDNN/MKL) and the native fp32 kernel: BLAS is slow for x @ W^T when x has few rows (on the 2-core
dev VM an expert FFN with 4-64 tokens ran ~2x faster as the weight-major W @ x^T, the weight streamed
once in its stored order), and the native kernel, which reads each weight once for all the rows in
registers, halves that again at 8-16 rows and stays 1.2-1.9x ahead up to a 256-row decode batch
(docs/quantization.md). Past 256 rows BLAS's own x @ W^T runs without a race: within ~15 % of the native
tile there, and racing a large weight (an lm_head) at 512+ rows would add seconds to every start. GPUs
do not need the race.

Quantized W races PyTorch's own kernels (`_weight_int8pack_mm`, the int4 "tinygemm" kernels,
dequantize-then-GEMM everywhere, for mxfp4 by one table lookup per byte, quant/mxfp4.py) and the native
ones (host_kernels.py: int8 and int4 pages converted in registers, with fp32 or int8 activations).

`exact` kernels give the GEMM on the dequantized weights (see KERNELS); the others round activations,
scales or partial sums to bfloat16, or activations to int8. `--expert-kernels exact` keeps only the
former; the default, `fastest`, allows both.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from moe_lightning.quant import host_kernels, scheme
from moe_lightning.quant.kernel_choice import MAX_BUCKET, POLICIES, Kernel, KernelChooser, weight_key
from moe_lightning.quant.mxfp4 import dequantize_mxfp4
from moe_lightning.quant.scheme import QuantFormat

DENSE_RACE_BELOW = 257  # rows of x under which a CPU's dense GEMM is raced (dense_linear); BLAS from there
WARM_UP_ROWS = MAX_BUCKET  # every bucket is measured at start: a step never pays for a measurement


@dataclass(slots=True, eq=False)
class QuantizedLinear:
    """A quantized linear layer's tensors (an expert page; the format is in scheme.py)."""

    format: QuantFormat
    qweight: torch.Tensor  # int8 (N, K) | uint8 (N, K/2) (int4, mxfp4)
    scales: torch.Tensor  # float32 (N,) | (N, K/G) | uint8 (N, K/32) e8m0 (mxfp4)
    zeros: torch.Tensor | None = None  # float32 (N, K/G) (int4)
    perm: torch.Tensor | None = None  # int32 (P, K): input order of each of P row blocks (act order)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (1 if self.format is QuantFormat.INT8 else 2)  # int4, mxfp4: 2 a byte

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def group_size(self) -> int:
        return self.in_features // self.scales.shape[1] if self.scales.dim() == 2 else self.in_features

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def components(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield "qweight", self.qweight
        yield "scales", self.scales
        if self.zeros is not None:
            yield "zeros", self.zeros
        if self.perm is not None:
            yield "perm", self.perm

    def tensors(self) -> Iterator[torch.Tensor]:
        for _, t in self.components():
            yield t

    def rows(self, start: int, stop: int) -> QuantizedLinear:
        """Output rows [start, stop) as views (no perm: the caller applies it)."""
        return QuantizedLinear(
            self.format,
            self.qweight[start:stop],
            self.scales[start:stop],
            None if self.zeros is None else self.zeros[start:stop],
        )

    def to(self, device: torch.device | str) -> QuantizedLinear:
        moved = {name: t.to(device) for name, t in self.components()}
        return QuantizedLinear(self.format, **moved)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (N, K) weight it stands for, columns in the model's order."""
        return dequantize(self, dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: (M, K) -> (M, N) in x's dtype, by the kernel chosen for this shape."""
        return quantized_linear(x, self)


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: (n, in), weight: (out, in) -> (n, out), by the kernel chosen for the shape (see the module doc).
    The result may be a transposed view; callers treat it as any (n, out) tensor."""
    if x.device.type == "cpu" and x.shape[0] < DENSE_RACE_BELOW:
        return CHOOSER.run(x, weight)
    return x @ weight.T


def _weight_major(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (weight @ x.T).T


def _matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.T


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 -> (N, K) uint8 values in [0, 15]."""
    n = qweight.shape[0]
    return torch.stack([qweight >> 4, qweight & 15], dim=-1).view(n, -1)


def _dequantize_rows(ql: QuantizedLinear, dtype: torch.dtype) -> torch.Tensor:
    """(N, K) in the permuted column order when ql has a perm (the kernels' order). Its scratch is one
    float32 copy of the rows (and the result beside it while rounding): scaled in place, since a second
    float32 copy doubled the peak for no change in the bits."""
    if ql.format is QuantFormat.INT8:
        return ql.qweight.to(torch.float32).mul_(ql.scales[:, None]).to(dtype)
    if ql.format is QuantFormat.MXFP4:  # straight into dtype: the table holds the exact products rounded once
        return dequantize_mxfp4(ql.qweight, ql.scales, dtype)
    assert ql.zeros is not None
    n, groups = ql.scales.shape
    q = unpack_int4(ql.qweight).view(n, groups, -1).to(torch.float32)  # (N, K/G, G)
    offset = (ql.zeros - 8 * ql.scales)[..., None]  # (q - 8) * s + z = q * s + (z - 8 s)
    return torch.addcmul(offset, q, ql.scales[..., None], out=q).view(n, -1).to(dtype)


def dequant_block_rows(out_features: int, in_features: int, device_type: str) -> int:
    """Output rows dequantized at a time on this device type (scheme.dequant_chunk): `_dequant_mm`'s
    and `dequantize`'s blocks."""
    return scheme.block_rows(out_features, in_features, scheme.dequant_chunk(device_type))


def _dequantize_blocks(ql: QuantizedLinear, dtype: torch.dtype, rows: int) -> torch.Tensor:
    """_dequantize_rows, `rows` rows at a time into one (N, K) result: the same bits, and no float32
    copy of more than a block (an LM head's would be gigabytes)."""
    if rows >= ql.out_features:
        return _dequantize_rows(ql, dtype)
    out = torch.empty(ql.out_features, ql.in_features, dtype=dtype, device=ql.device)
    for start in range(0, ql.out_features, rows):
        stop = min(start + rows, ql.out_features)
        out[start:stop] = _dequantize_rows(ql.rows(start, stop), dtype)
    return out


def dequantize(ql: QuantizedLinear, dtype: torch.dtype = torch.float32, rows: int | None = None) -> torch.Tensor:
    """The (N, K) weight in `dtype`, columns in the model's order; `rows` at a time (default: the
    device's dequantization block)."""
    if rows is None:
        rows = dequant_block_rows(ql.out_features, ql.in_features, ql.device.type)
    w = _dequantize_blocks(ql, dtype, rows)
    if ql.perm is None:
        return w
    out = torch.empty_like(w)
    part = ql.out_features // ql.perm.shape[0]
    for p in range(ql.perm.shape[0]):
        out[p * part : (p + 1) * part, ql.perm[p].long()] = w[p * part : (p + 1) * part]
    return out


# --- the candidates: (x (M, K) in ql's column order, ql without perm) -> (M, N) in x.dtype -------
# The GEMM on the dequantized rows is dense_linear's, so its own race (a CPU, below DENSE_RACE_BELOW
# rows) runs inside dequant_mm's first call at a new shape: the result is the dense GEMM's, bit for bit.
def _dequant_mm(x: torch.Tensor, ql: QuantizedLinear) -> torch.Tensor:
    return _dequant_mm_blocks(x, ql, dequant_block_rows(ql.out_features, ql.in_features, x.device.type))


def _dequant_mm_blocks(x: torch.Tensor, ql: QuantizedLinear, rows: int) -> torch.Tensor:
    """`rows` output rows at a time, so that no float32 copy of more than a block exists (a Mixtral
    w13, 117 M weights, is 28 blocks on a CPU and 2 on CUDA; an LM head is never whole in float32);
    each output column is the GEMM on its rows' dequantization, whatever the blocks."""
    if rows >= ql.out_features:
        return dense_linear(x, _dequantize_rows(ql, x.dtype))
    out = torch.empty(x.shape[0], ql.out_features, dtype=x.dtype, device=x.device)
    for start in range(0, ql.out_features, rows):
        stop = min(start + rows, ql.out_features)
        out[:, start:stop] = dense_linear(x, _dequantize_rows(ql.rows(start, stop), x.dtype))
    return out


def _mxfp4_dequant_mm_bf16(x: torch.Tensor, ql: QuantizedLinear) -> torch.Tensor:
    """mxfp4 dequantized to bfloat16, which holds every e2m1 value times every e8m0 scale exactly
    (so only the activations are rounded, not the weight), then a bf16 GEMM: half the scratch bytes
    of the fp32 copy, and tensor cores on a GPU; on a CPU with native bf16 the faster GEMM at few
    rows. For bf16 activations it is dequant_mm, so it races for the others only."""
    return _dequant_mm(x.to(torch.bfloat16), ql).to(x.dtype)


def _mxfp4_dequant_mm_fp32(x: torch.Tensor, ql: QuantizedLinear) -> torch.Tensor:
    """16-bit activations widened (exactly) and the GEMM in fp32 on the fp32 dequantization, rounded
    once to x's dtype: a CPU without native bf16 (AVX2) runs a bf16 GEMM ~6x slower than fp32's from
    64 rows on (docs/quantization.md). For fp32 activations it is dequant_mm."""
    return _dequant_mm(x.float(), ql).to(x.dtype)


def _int8mm(x: torch.Tensor, ql: QuantizedLinear) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x, ql.qweight, ql.scales.to(x.dtype))


def _int8mm_bf16(x: torch.Tensor, ql: QuantizedLinear) -> torch.Tensor:
    y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), ql.qweight, ql.scales.to(torch.bfloat16))
    return y.to(x.dtype)


def _scales_and_zeros(ql: QuantizedLinear, dtype: torch.dtype) -> torch.Tensor:
    assert ql.zeros is not None
    return torch.stack([ql.scales.t(), ql.zeros.t()], dim=-1).to(dtype).contiguous()  # (K/G, N, 2)


def _int4mm_cpu(x: torch.Tensor, ql: QuantizedLinear) -> torch.Tensor:
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(ql.qweight).to(torch.int32), 1)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, ql.group_size, _scales_and_zeros(ql, x.dtype))


def _int4mm_cuda(x: torch.Tensor, ql: QuantizedLinear) -> torch.Tensor:
    packed = torch.ops.aten._convert_weight_to_int4pack(ql.qweight, 8)
    xb = x.to(torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm(xb, packed, ql.group_size, _scales_and_zeros(ql, torch.bfloat16))
    return y.to(x.dtype)


def _int4_grouped_int8mm_bf16(x: torch.Tensor, ql: QuantizedLinear) -> torch.Tensor:
    """int4 as int8 group by group (q - 8 fits int8): sum_g x_g @ ((q_g - 8) s_g)^T + (sum_g x_g) z_g."""
    assert ql.zeros is not None
    n, groups = ql.scales.shape
    g = ql.in_features // groups
    q8 = (unpack_int4(ql.qweight).view(torch.int8) - 8).view(n, groups, g).transpose(0, 1).contiguous()
    xb = x.to(torch.bfloat16)
    scales = ql.scales.t().to(torch.bfloat16).contiguous()  # (K/G, N)
    y = x.view(x.shape[0], groups, g).float().sum(dim=-1) @ ql.zeros.t()  # (M, N): the zeros' share
    for j in range(groups):
        y += torch.ops.aten._weight_int8pack_mm(xb[:, j * g : (j + 1) * g].contiguous(), q8[j], scales[j]).float()
    return y.to(x.dtype)


def _int4_int8act_intmm(x: torch.Tensor, ql: QuantizedLinear) -> torch.Tensor:
    """int4 weights times activations quantized to int8 per (row, group), int32 sums by
    `torch._int_mm` (VNNI where the CPU has it), never widening the weight past int8. The nibbles are
    used where they lie: even columns from the high ones, odd from the low, two GEMMs per group."""
    assert ql.zeros is not None
    n, groups = ql.scales.shape
    m, half = x.shape[0], ql.in_features // groups // 2
    hi = (ql.qweight >> 4).view(torch.int8).view(n, groups, half)  # q in [0, 15], even columns
    lo = (ql.qweight & 15).view(torch.int8).view(n, groups, half)  # odd columns
    xg = x.float().view(m, groups, 2 * half)
    sx = xg.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny) / 127  # (M, K/G)
    xq = torch.round(xg / sx[..., None]).to(torch.int8)
    xe, xo = (xq[..., p::2].transpose(0, 1).contiguous() for p in (0, 1))  # (K/G, M, G/2)
    acc = torch.empty(groups, m, n, dtype=torch.int32, device=x.device)
    for j in range(groups):
        torch._int_mm(xe[j], hi[:, j].t(), out=acc[j])
        acc[j] += torch._int_mm(xo[j], lo[:, j].t())
    y = acc.float().mul_(sx.t()[:, :, None]).mul_(ql.scales.t()[:, None, :]).sum(0)
    # w = (q - 8) s + z: the (z - 8 s) share multiplies the sum of the (quantized) activations
    xsum = xq.sum(-1, dtype=torch.int32).float() * sx
    return (y + xsum @ (ql.zeros - 8 * ql.scales).t()).to(x.dtype)


Weight = torch.Tensor | QuantizedLinear  # dense (format none) or quantized


# Exact: the result is the GEMM on the dequantized weights (fp32 dequantization rounded once to x's
# dtype), up to the order of the sums. Kernels that take scales (and zeros) in x's dtype are exact
# only in fp32; those that round activations or scales to bf16 never are.
# The native kernels compute in fp32 whatever x's dtype: exact in fp32 (`*_f32`, dense_native), never
# with int8 activations (`*_i8`, ~0.7 % of the output's largest value).
FP32 = (torch.float32,)
CPU_ONLY = ("cpu",)
KERNELS = (
    Kernel("weight_major", QuantFormat.NONE, _weight_major),
    Kernel("matmul", QuantFormat.NONE, _matmul),
    Kernel("dense_native", QuantFormat.NONE, host_kernels.dense_native, CPU_ONLY, raced_for=FP32, native=True),
    Kernel("dequant_mm", QuantFormat.INT8, _dequant_mm),
    Kernel("int8mm", QuantFormat.INT8, _int8mm, exact_for=FP32),
    Kernel("int8mm_bf16", QuantFormat.INT8, _int8mm_bf16, exact_for=()),
    Kernel("int8_native_f32", QuantFormat.INT8, host_kernels.int8_f32, CPU_ONLY, exact_for=FP32, native=True),
    Kernel("int8_native_i8", QuantFormat.INT8, host_kernels.int8_i8, CPU_ONLY, exact_for=(), native=True),
    Kernel("dequant_mm", QuantFormat.INT4, _dequant_mm),
    Kernel("int4_native_f32", QuantFormat.INT4, host_kernels.int4_f32, CPU_ONLY, exact_for=FP32, native=True),
    Kernel("int4_native_i8", QuantFormat.INT4, host_kernels.int4_i8, CPU_ONLY, exact_for=(), native=True),
    Kernel("int4mm_cpu", QuantFormat.INT4, _int4mm_cpu, devices=("cpu",), exact_for=FP32),
    Kernel("int4_grouped_int8mm_bf16", QuantFormat.INT4, _int4_grouped_int8mm_bf16, ("cpu",), exact_for=()),
    Kernel("int4_int8act_intmm", QuantFormat.INT4, _int4_int8act_intmm, ("cpu",), exact_for=()),
    Kernel("int4mm_cuda", QuantFormat.INT4, _int4mm_cuda, devices=("cuda",), exact_for=()),
    Kernel("dequant_mm", QuantFormat.MXFP4, _dequant_mm),
    # where x's dtype makes one of these dequant_mm itself, it is not raced against itself
    Kernel(
        "mxfp4_dequant_mm_bf16",
        QuantFormat.MXFP4,
        _mxfp4_dequant_mm_bf16,
        exact_for=(torch.bfloat16,),
        raced_for=(torch.float32, torch.float16),
    ),
    Kernel(
        "mxfp4_dequant_mm_fp32",
        QuantFormat.MXFP4,
        _mxfp4_dequant_mm_fp32,
        exact_for=(torch.float32, torch.bfloat16),  # fp16 would round the extreme scales' weights
        raced_for=(torch.bfloat16, torch.float16),
    ),
)


CHOOSER = KernelChooser(KERNELS)


def configure(policy: str = "fastest", only: str | None = None, settle: bool = True) -> KernelChooser:
    """Sets this process's kernel policy (gpu_expert's --expert-kernels) and forgets past choices.
    `settle=False`: a bucket keeps the race's winner (every call of a shape then sums in one order)."""
    global CHOOSER
    if policy not in POLICIES:
        raise ValueError(f"--expert-kernels must be one of {', '.join(POLICIES)}, got {policy!r}")
    if only is not None and only not in {k.name for k in KERNELS}:
        raise ValueError(f"unknown kernel {only!r}: one of {', '.join(sorted({k.name for k in KERNELS}))}")
    CHOOSER = KernelChooser(KERNELS, policy, only, settle=settle)
    return CHOOSER


def chooser() -> KernelChooser:
    return CHOOSER


def warm_up(linears: Sequence[Weight], dtype: torch.dtype, max_rows: int = WARM_UP_ROWS) -> None:
    """Chooses the kernels of these weights (one per distinct shape) for every rows bucket up to
    `max_rows` (a dense weight's up to DENSE_RACE_BELOW, on a CPU), so that steps do not pay for the
    measurements."""
    distinct: dict[tuple, Weight] = {}
    for w in linears:
        distinct.setdefault((str(w.device), *weight_key(w), getattr(w, "perm", None) is None), w)
    for w in distinct.values():
        dense = isinstance(w, torch.Tensor)
        if dense and (w.device.type != "cpu" or w.dtype != dtype):
            continue  # dense_linear races on a CPU only; a weight kept in fp32 (a sigmoid router) is F.linear's
        top = min(max_rows, DENSE_RACE_BELOW - 1 if dense else MAX_BUCKET)
        rows = 1
        while True:
            n = min(rows, top)
            x = torch.randn(n, w.shape[1], device=w.device).to(dtype)
            if isinstance(w, torch.Tensor):
                dense_linear(x, w)
            else:
                quantized_linear(x, w)
            if n == top:
                break
            rows *= 2


def quantized_linear(x: torch.Tensor, ql: QuantizedLinear) -> torch.Tensor:
    """x: (M, K) -> (M, N), applying the activation order part by part when ql has one."""
    x = x.contiguous()  # the packed kernels take row-major activations only
    if ql.perm is None:
        return CHOOSER.run(x, ql)
    parts = ql.perm.shape[0]
    rows = ql.out_features // parts
    outs = []
    for p in range(parts):
        part = ql.rows(p * rows, (p + 1) * rows)
        xp = x[:, ql.perm[p].long()]  # (M, K) in the order the part's groups were formed
        outs.append(CHOOSER.run(xp, part))
    return torch.cat(outs, dim=-1)
