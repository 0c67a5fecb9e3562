"""y = x @ W^T by whichever kernel is fastest for the shape on this machine, and the quantized W
(QuantizedLinear: a layer's tensors, in the formats of scheme.py) it runs over.

No kernel is fastest everywhere, so the first call of each (weight format and shape, rows bucket, dtype)
races every candidate on the real operands and keeps the winner: warm-up is when that happens. On a
CPU a runner-up within SETTLE_WITHIN of the winner is tried against it on the step's own calls, and the
faster there keeps the bucket (Settling).

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

import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
from prometheus_client import Gauge

from moe_lightning.quant import host_kernels, scheme
from moe_lightning.quant.mxfp4 import dequantize_mxfp4
from moe_lightning.quant.scheme import QuantFormat

DENSE_RACE_BELOW = 257  # rows of x under which a CPU's dense GEMM is raced (dense_linear); BLAS from there
POLICIES = ("fastest", "exact")
MAX_BUCKET = 1024
WARM_UP_ROWS = MAX_BUCKET  # every bucket is measured at start: a step never pays for a measurement
PRUNE_BEHIND = 8.0  # far behind the best ...
GROWS = 1.5  # ... and slower by this much per doubling of the rows: not timed at more rows (_pruned)
RACE_ROUNDS = 5
# A runner-up the race timed within SETTLE_WITHIN of the winner (on a CPU) is settled on the calls
# themselves: SETTLE_CALLS of each, in a random order, and the faster on average keeps the bucket
# (see Settling).
SETTLE_WITHIN = 1.15
SETTLE_CALLS = 24
# ... for weights of this many bytes or more: read from DRAM at every call, where the race's one evicted
# weight misleads; a smaller weight's call takes microseconds, and its bucket keeps the race's winner
# from the first call (the same inputs then sum in one order from the start, as the tests of the API's
# scoring compare request to request)
SETTLE_MIN_BYTES = 4 << 20
CHOSEN = Gauge(
    "moe_lightning_expert_kernel_seconds",
    "Time of the quantized kernel chosen for a weight shape and rows bucket, as measured when chosen",
    ["shape", "rows", "kernel"],
)
DENSE_CHOSEN = Gauge(
    "moe_lightning_dense_kernel_seconds",
    "Time of the dense GEMM kernel chosen for a weight shape and rows bucket (a CPU's), as measured when chosen",
    ["shape", "rows", "kernel"],
)


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
    """(N, K) in the permuted column order when ql has a perm (the kernels' order)."""
    if ql.format is QuantFormat.INT8:
        return (ql.qweight.to(torch.float32) * ql.scales[:, None]).to(dtype)
    if ql.format is QuantFormat.MXFP4:  # straight into dtype: the table holds the exact products rounded once
        return dequantize_mxfp4(ql.qweight, ql.scales, dtype)
    assert ql.zeros is not None
    n, groups = ql.scales.shape
    q = unpack_int4(ql.qweight).view(n, groups, -1).to(torch.float32)  # (N, K/G, G)
    offset = (ql.zeros - 8 * ql.scales)[..., None]  # (q - 8) * s + z = q * s + (z - 8 s)
    return torch.addcmul(offset, q, ql.scales[..., None]).view(n, -1).to(dtype)


def dequantize(ql: QuantizedLinear, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    w = _dequantize_rows(ql, dtype)
    if ql.perm is None:
        return w
    out = torch.empty_like(w)
    rows = ql.out_features // ql.perm.shape[0]
    for p in range(ql.perm.shape[0]):
        out[p * rows : (p + 1) * rows, ql.perm[p].long()] = w[p * rows : (p + 1) * rows]
    return out


# --- the candidates: (x (M, K) in ql's column order, ql without perm) -> (M, N) in x.dtype -------
def dequant_block_rows(out_features: int, in_features: int, device_type: str) -> int:
    """Output rows `_dequant_mm` dequantizes at a time on this device type (scheme.dequant_chunk)."""
    chunk = scheme.dequant_chunk(device_type)
    if chunk >= out_features * in_features:
        return out_features
    return max(1, int(chunk) // in_features)


# The GEMM on the dequantized rows is dense_linear's, so its own race (a CPU, below DENSE_RACE_BELOW
# rows) runs inside dequant_mm's first call at a new shape: the result is the dense GEMM's, bit for bit.
def _dequant_mm(x: torch.Tensor, ql: QuantizedLinear) -> torch.Tensor:
    return _dequant_mm_blocks(x, ql, dequant_block_rows(ql.out_features, ql.in_features, x.device.type))


def _dequant_mm_blocks(x: torch.Tensor, ql: QuantizedLinear, rows: int) -> torch.Tensor:
    """`rows` output rows at a time, so that on a CPU a Mixtral w13 (117 M weights) never exists whole
    in fp32; the result is the same as one dequantization."""
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
Fn = Callable[[torch.Tensor, Any], torch.Tensor]  # (x, the weight of its kernel's format) -> x @ W^T


@dataclass(frozen=True, slots=True)
class Kernel:
    name: str
    format: QuantFormat  # NONE: a dense weight
    fn: Fn
    devices: tuple[str, ...] = ("cpu", "cuda")
    exact_for: tuple[torch.dtype, ...] | None = None  # x's dtypes it is exact for; None: all
    raced_for: tuple[torch.dtype, ...] | None = None  # x's dtypes it is a candidate for; None: all
    native: bool = False  # one of host_kernels.py's: only where the extension is built

    def races(self, dtype: torch.dtype) -> bool:
        return self.raced_for is None or dtype in self.raced_for

    def exact(self, dtype: torch.dtype) -> bool:
        return self.exact_for is None or dtype in self.exact_for

    def usable(self, device: torch.device) -> bool:
        if device.type not in self.devices:
            return False
        if self.name == "int4mm_cuda":  # tinygemm needs tensor cores of compute capability 8.0+
            return torch.cuda.get_device_capability(device) >= (8, 0)
        return not self.native or host_kernels.available()


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


def _weight_key(w: Weight) -> tuple[QuantFormat, tuple[int, ...], int]:
    """(format, shape, group size) of a weight: what its kernels' speed depends on besides x."""
    if isinstance(w, torch.Tensor):
        return QuantFormat.NONE, tuple(w.shape), 0
    return w.format, w.shape, w.group_size


def rows_bucket(m: int) -> int:
    return min(MAX_BUCKET, 1 << max(0, math.ceil(math.log2(max(1, m)))))


@dataclass(slots=True)
class Settling:
    """The race's winner and a runner-up it timed within SETTLE_WITHIN of it, both tried on the calls
    a step makes until each has run SETTLE_CALLS of them. At decode's 16-32 rows per expert the fp32
    kernels come within a few percent of each other in the race, and which wins flipped from one start
    to the next (the other services starting beside it, the weight read once where a step streams
    gigabytes), while on a step's calls one stays 5-10 % ahead (docs/quantization.md, "Kernels"). The
    order is drawn at random, not alternated: a layer's experts come in the same order every step, and
    a bucket's calls in turns would give each kernel the same experts (and their row counts) each time."""

    kernels: tuple[Kernel, Kernel]
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0])
    calls: list[int] = field(default_factory=lambda: [0, 0])
    draw: random.Random = field(default_factory=lambda: random.Random(0))

    def next(self) -> int:
        """Which kernel runs the next call: either at random until one has had its share."""
        if self.calls[0] >= SETTLE_CALLS:
            return 1
        if self.calls[1] >= SETTLE_CALLS:
            return 0
        return self.draw.randrange(2)

    def settled(self) -> bool:
        return min(self.calls) >= SETTLE_CALLS

    def means(self) -> tuple[float, float]:
        return self.seconds[0] / max(1, self.calls[0]), self.seconds[1] / max(1, self.calls[1])


@dataclass(slots=True)
class Choice:
    kernel: Kernel
    seconds: dict[str, float]  # every candidate's time on the operands it was chosen with
    pruned: frozenset[str] = frozenset()  # not timed: far behind and slower the more rows (see _pruned)
    settling: Settling | None = None  # a near tie, being settled on the calls (then None)
    settled: dict[str, float] = field(default_factory=dict)  # the mean call each had when it was


@dataclass(slots=True)
class KernelChooser:
    policy: str = "fastest"
    only: str | None = None  # one kernel by name (tests, benchmarks of a single kernel)
    table: dict[tuple, Choice] = field(default_factory=dict)
    settle: bool = True  # near ties settled on the calls (Settling); False: the race's winner stays

    def candidates(self, fmt: QuantFormat, device: torch.device, dtype: torch.dtype) -> list[Kernel]:
        """The kernels raced for `fmt` weights: `only` where it names one of this format's (the other
        formats keep the policy's), else the policy's."""
        found = [k for k in KERNELS if k.format is fmt and k.usable(device) and k.races(dtype)]
        if self.only is not None and any(k.name == self.only and k.format is fmt for k in KERNELS):
            found = [k for k in found if k.name == self.only]
        elif self.policy == "exact":
            found = [k for k in found if k.exact(dtype)]
        if not found:
            raise ValueError(f"no {self.only or self.policy} kernel for {fmt} weights on {device.type}")
        return found

    def pick(self, x: torch.Tensor, w: Weight) -> Kernel:
        return self._choice(x, w)[0].kernel

    def run(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """x @ W^T by the bucket's kernel; while a near tie is being settled, by either (timed)."""
        choice, fresh = self._choice(x, w)
        trial = choice.settling
        if trial is None or fresh:  # the call that raced ran over a weight the race had just read
            return choice.kernel.fn(x, w)
        i = trial.next()
        y, seconds = _timed_call(trial.kernels[i].fn, x, w)
        trial.seconds[i] += seconds
        trial.calls[i] += 1
        if trial.settled():
            self._settle(x, w, choice, trial)
        return y

    def _choice(self, x: torch.Tensor, w: Weight) -> tuple[Choice, bool]:
        key = (str(x.device), *_weight_key(w), rows_bucket(x.shape[0]), x.dtype)
        choice = self.table.get(key)
        if choice is not None:
            return choice, False
        choice = self.table[key] = self._measure(x, w, key)
        return choice, True

    def _settle(self, x: torch.Tensor, w: Weight, choice: Choice, trial: Settling) -> None:
        means = trial.means()
        best = trial.kernels[0 if means[0] <= means[1] else 1]
        fmt, shape, _ = _weight_key(w)
        gauge = DENSE_CHOSEN if fmt is QuantFormat.NONE else CHOSEN
        labels = ("x".join(map(str, shape)), str(rows_bucket(x.shape[0])))
        if best is not choice.kernel:
            gauge.remove(*labels, choice.kernel.name)
        gauge.labels(*labels, best.name).set(min(means))
        choice.kernel, choice.settling = best, None
        choice.settled = {k.name: m for k, m in zip(trial.kernels, means, strict=True)}
        structlog.get_logger().info(
            "kernel_settled",
            format=str(fmt),
            shape=list(shape),
            rows=int(labels[1]),
            kernel=best.name,
            mean_ms={k: round(m * 1e3, 3) for k, m in choice.settled.items()},
        )

    def _measure(self, x: torch.Tensor, ql: Weight, key: tuple) -> Choice:
        found = self.candidates(key[1], x.device, x.dtype)
        if len(found) == 1 and self.only is not None:
            return Choice(found[0], {})
        pruned = self._pruned(key)
        found = [k for k in found if k.name not in pruned] or found
        first = {k.name: t for k in found if (t := _first_call(k, x, ql)) is not None}
        behind = _far_behind(first) if x.device.type == "cpu" else {}
        seconds = _race([k for k in found if k.name in first and k.name not in behind], x, ql)
        seconds.update(behind)
        if not seconds:
            raise RuntimeError(f"every kernel for {key[1]} on {x.device} failed")
        best = min(seconds, key=seconds.__getitem__)
        gauge = DENSE_CHOSEN if key[1] is QuantFormat.NONE else CHOSEN
        gauge.labels("x".join(map(str, key[2])), str(key[4]), best).set(seconds[best])
        structlog.get_logger().info(
            "kernel_chosen",
            format=str(key[1]),
            shape=list(key[2]),
            rows=key[4],
            dtype=str(x.dtype).removeprefix("torch."),
            kernel=best,
            ms={k: round(v * 1e3, 3) for k, v in seconds.items()},
        )
        winner = next(k for k in found if k.name == best)
        tie = _near_tie(winner, found, seconds, x.device) if self.settle and _nbytes(ql) >= SETTLE_MIN_BYTES else None
        return Choice(winner, seconds, frozenset(pruned), tie)

    def _pruned(self, key: tuple) -> set[str]:
        """Kernels not worth timing at this rows bucket: more than PRUNE_BEHIND times slower than the
        best at half the rows and growing with the rows (at least GROWS times their time at a quarter),
        so they cannot catch up (int4mm_cpu here: 8 s a call at 1024 rows). One whose time is mostly
        fixed (dequantizing the page) is kept: with more rows the others may fall behind it."""
        half = self.table.get((*key[:4], key[4] // 2, *key[5:]))
        if half is None or not half.seconds or key[4] < 2:
            return set()
        quarter = self.table.get((*key[:4], key[4] // 4, *key[5:]))
        best = min(half.seconds.values())
        out = set(half.pruned)
        for name, t in half.seconds.items():
            earlier = quarter.seconds.get(name) if quarter is not None else None
            if t > PRUNE_BEHIND * best and earlier is not None and t >= GROWS * earlier:
                out.add(name)
        return out

    def report(self) -> list[dict]:
        """What won for each shape and rows bucket, with the times it won by (benchmarks print it)."""
        return [
            {
                "format": str(key[1]),
                "shape": list(key[2]),
                "rows": key[4],
                "dtype": str(key[5]).removeprefix("torch."),
                "kernel": c.kernel.name,
                "ms": {k: round(v * 1e3, 3) for k, v in c.seconds.items()},
                "settled_ms": {k: round(v * 1e3, 3) for k, v in c.settled.items()},  # {}: no near tie
            }
            for key, c in self.table.items()
        ]


def _nbytes(w: Weight) -> int:
    tensors = [w] if isinstance(w, torch.Tensor) else list(w.tensors())
    return sum(t.numel() * t.element_size() for t in tensors)


def _near_tie(winner: Kernel, found: list[Kernel], seconds: dict[str, float], device: torch.device) -> Settling | None:
    """The winner and its closest runner-up where the race could not tell them apart (a CPU's: a CUDA
    call would need a synchronisation to be timed)."""
    if device.type != "cpu":
        return None
    others = sorted((t, k.name) for k in found if k is not winner and (t := seconds.get(k.name)) is not None)
    if not others or others[0][0] > SETTLE_WITHIN * seconds[winner.name]:
        return None
    return Settling((winner, next(k for k in found if k.name == others[0][1])))


def _timed_call(fn: Fn, x: torch.Tensor, ql: Weight) -> tuple[torch.Tensor, float]:
    """A step's call to a kernel being settled (a CPU's: no synchronisation to wait for), and its time."""
    t0 = time.perf_counter()
    y = fn(x, ql)
    return y, time.perf_counter() - t0


def _first_call(kernel: Kernel, x: torch.Tensor, ql: Weight) -> float | None:
    """A first call, not counted in the race (it may load or compile the kernel): its seconds, or None
    if this build or device lacks the kernel."""
    try:
        return _cold_once(kernel.fn, x, ql)
    except torch.OutOfMemoryError:
        raise  # not a missing kernel: the step's own error handling says so
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        error = str(exc).splitlines()[0] if str(exc) else repr(exc)
        structlog.get_logger().warning("kernel_unavailable", kernel=kernel.name, error=error)
        return None


def _far_behind(first: dict[str, float]) -> dict[str, float]:
    """The kernels whose first call alone took PRUNE_BEHIND times the best first call: on a CPU a
    first call costs what the next ones do (nothing loads lazily; these kernels keep no state), and
    timing such a kernel again in the race is what made choosing slow (int4mm_cpu: 1.5 s a call at
    256 rows, where dequant_mm takes 40 ms). Timed once, it keeps that time in the Choice."""
    if not first:
        return {}
    best = min(first.values())
    return {name: t for name, t in first.items() if t > PRUNE_BEHIND * best}


def _race(found: list[Kernel], x: torch.Tensor, ql: Weight, rounds: int = RACE_ROUNDS) -> dict[str, float]:
    """Each kernel's best time over `rounds`, the kernels taking turns within a round, so that a
    burst of load from the other processes (a service starting, the arena copy being written) falls
    on all of them alike; one more than 4x behind the best after a round runs no more."""
    times: dict[str, float] = {}
    alive = list(found)
    for _ in range(rounds):
        for kernel in alive:
            times[kernel.name] = min(times.get(kernel.name, math.inf), _cold_once(kernel.fn, x, ql))
        best = min(times.values())
        alive = [k for k in alive if times[k.name] <= 4 * best]
    return times


def _cold_once(fn: Fn, x: torch.Tensor, ql: Weight) -> float:
    """One call over a weight that comes from DRAM, on a CPU that can evict it (host_kernels.evict): a
    decode step reads each host weight once, after gigabytes of the others, while a weight the race has
    just read sits in the L3, where the kernels rank otherwise (MKL's `weight_major` ahead of
    `dense_native` at 16 rows there, behind it from DRAM; docs/quantization.md, "Kernels")."""
    if x.device.type == "cpu":
        host_kernels.evict([ql] if isinstance(ql, torch.Tensor) else list(ql.tensors()))
    return _once(fn, x, ql)


def _once(fn: Fn, x: torch.Tensor, ql: Weight) -> float:
    _sync(x.device)
    t0 = time.perf_counter()
    fn(x, ql)
    _sync(x.device)
    return time.perf_counter() - t0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Fn, x: torch.Tensor, ql: Weight, reps: int = 3) -> float:
    """Best of `reps` after an uncounted warm call (bench/quant_kernels.py)."""
    fn(x, ql)
    return min(_once(fn, x, ql) for _ in range(reps))


CHOOSER = KernelChooser()


def configure(policy: str = "fastest", only: str | None = None, settle: bool = True) -> KernelChooser:
    """Sets this process's kernel policy (gpu_expert's --expert-kernels) and forgets past choices.
    `settle=False`: a bucket keeps the race's winner (every call of a shape then sums in one order)."""
    global CHOOSER
    if policy not in POLICIES:
        raise ValueError(f"--expert-kernels must be one of {', '.join(POLICIES)}, got {policy!r}")
    if only is not None and only not in {k.name for k in KERNELS}:
        raise ValueError(f"unknown kernel {only!r}: one of {', '.join(sorted({k.name for k in KERNELS}))}")
    CHOOSER = KernelChooser(policy, only, settle=settle)
    return CHOOSER


def chooser() -> KernelChooser:
    return CHOOSER


def warm_up(linears: Sequence[Weight], dtype: torch.dtype, max_rows: int = WARM_UP_ROWS) -> None:
    """Chooses the kernels of these weights (one per distinct shape) for every rows bucket up to
    `max_rows` (a dense weight's up to DENSE_RACE_BELOW, on a CPU), so that steps do not pay for the
    measurements."""
    distinct: dict[tuple, Weight] = {}
    for w in linears:
        distinct.setdefault((str(w.device), *_weight_key(w), getattr(w, "perm", None) is None), w)
    for w in distinct.values():
        dense = isinstance(w, torch.Tensor)
        if dense and w.device.type != "cpu":
            continue  # dense_linear races on a CPU only
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
