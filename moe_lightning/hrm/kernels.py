"""The expert GEMM's kernels as the roofline sees them, per page format (docs/hrm.md, "Quantized experts").

A kernel is described relative to its side's dense roofs (the matmul peak and the memory bandwidth the
profile has for that side): the share of the peak it reaches when compute-bound, the memory bytes it
moves per weight per call (reads, writes of temporaries, the GEMM's own read), and the scratch it
allocates per call. The cost model takes, per stage, the fastest kernel the side has, as
moe_lightning/quant/kernels.py does by measuring them at warm-up.

Sources of the numbers (W weights, b bytes of the model dtype, p page bytes per weight):

* unquantized: reads b per weight at the full peak.
* dequantize-then-GEMM (moe_lightning/quant/kernels.py `_dequant_mm`, eager PyTorch; the only int8
  path on CUDA, the only int4 one below compute capability 8.0, e.g. T4): every step of
  `_dequantize_rows` is a pass over memory. int8: to float32 (read 1, write 4), x scale (4 + 4), to the
  model dtype (4 + b, none in float32), the GEMM (b): 21 bytes per weight in bf16 against 2 unquantized.
  int4: unpacking the nibbles (4), to float32 (1 + 4), addcmul (4 + 4), to the dtype (4 + b), the GEMM
  (b): 25. Its scratch is the float32 copy of the rows dequantized at once, scaled in place, and the
  result beside it while rounding: int8 4 + b (4 in float32), int4 the larger of the unpacked bytes
  and the float32 copy (1 + 4) and 4 + b; on CUDA, where this model applies, for a block of at most
  64 Mi weights (moe_lightning/quant/scheme.py `dequant_chunk`, which the kernel reads too: 256 MiB of
  float32, a Mixtral w13 in 2 blocks). A fused dequantization would read p and write b once.
* int4 tinygemm (`_weight_int4pack_mm`, compute capability 8.0+): repacks the page per call (read and
  write 0.5), reads the repacked weight (0.5) and the scales and zeros converted to bfloat16 (reading,
  stacking and converting the float32 ones moves 4x their page bytes): 1.5 + 4 (p - 0.5) bytes per
  weight, 1.75 at group size 128. It is built for a few rows per GEMM; its rate when compute-bound is
  an assumption (a quarter of the tensor-core peak), not measured here.
* host (CPU) kernels: the native ones (quant/host_kernels.py, activations quantized to int8, VNNI dot
  products), measured on the 2-core AVX-512 VNNI dev VM (2026-12-04, `bench/quant_kernels.py`, 8
  distinct weights so that each is read from memory) against its own fp32 GEMMs: a (7168, 1024) weight
  at 1 row took 1.13 ms in fp32 (the native kernel, 26 GB/s), 0.42 in int8 and 0.30 in int4: 1.5 and
  1.1 bytes per weight at the dense bandwidth (a (1024, 3584) one: 1.3 and 1.0); at 64 rows 2.77 ms in
  both, 340 GFLOP/s, 1.7x the 2048^3 fp32 GEMM's ~200 (int4 on the (1024, 3584) one: 1.4x), since
  4-byte integer dot products do 4x the multiply-adds of an fp32 FMA a cycle. An AVX2 CPU runs the
  same kernels without VNNI (pmaddubsw) and the older dev VM's PyTorch kernels were slower still (int4
  at 8 bytes per weight, 0.6 of the peak): a calibrated profile measures its own.
  mxfp4 (dequantize-then-GEMM by a table gather) took 5.8 ms at 1 row and 11.4 ms at 64 on a
  (7168, 1024) weight against fp32 dense's 1.3 and 6.6 on the same machine: ~18 bytes per weight at
  the dense bandwidth, 0.6 of the peak. On CUDA its traffic is the page (0.53), the int32 indices written,
  or-ed and read (2 + 4 + 2), the result written and read by the GEMM (b + b); its scratch the
  indices and the result (2 + b).

A calibrated profile that measured the expert GEMM on pages of the planned format (hardware.py
`expert_format`, `expert_flops`, `expert_bandwidth`) replaces all of this by the one kernel it measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_lightning.hrm.hardware import HardwareProfile
from moe_lightning.quant.scheme import QuantFormat, QuantScheme, dequant_chunk

MXFP4_PAGE = 0.5 + 1 / 32  # page bytes per weight: two e2m1 values a byte, an e8m0 scale per 32
TINYGEMM_FLOPS = 0.25  # assumed share of the tensor-core peak for int4 tinygemm at large row counts
TINYGEMM_MIN_CAPABILITY = 8.0


@dataclass(frozen=True, slots=True)
class KernelRoof:
    name: str
    flops: float  # share of the side's matmul peak it reaches when compute-bound
    traffic: float  # memory bytes it moves per weight per call
    scratch: float = 0.0  # bytes per weight of one linear it allocates per call
    scratch_weights: float = math.inf  # ... for at most this many weights at a time

    def scratch_bytes(self, weights: float) -> float:
        return self.scratch * min(weights, self.scratch_weights)

    def seconds(self, flops: float, weights: float, peak: float, bandwidth: float) -> float:
        return max(flops / (peak * self.flops), weights * self.traffic / bandwidth)


def _dequant(fmt: QuantFormat, b: int) -> KernelRoof:
    """On the device side only (a host sharing the device takes HOST_KERNELS): CUDA's chunk."""
    rounding = 0 if b == 4 else 4 + b  # to the model dtype; a no-op in float32
    chunk = dequant_chunk("cuda")
    result = 0 if b == 4 else b  # the rounded copy beside the float32 one (none in float32)
    if fmt is QuantFormat.INT8:
        return KernelRoof("dequant_mm", 1.0, 5 + 8 + rounding + b, 4.0 + result, chunk)
    if fmt is QuantFormat.MXFP4:  # a table gather straight into the dtype: no float32 copy to round
        return KernelRoof("dequant_mm", 1.0, MXFP4_PAGE + 2 + 4 + 2 + b + b, 2.0 + b, chunk)
    return KernelRoof("dequant_mm", 1.0, 4 + 5 + 8 + rounding + b, max(1.0 + 4, 4.0 + result), chunk)


def _tinygemm(page_bpw: float) -> KernelRoof:
    scales = page_bpw - 0.5  # scales and zeros per weight in the page
    return KernelRoof("int4mm_cuda", TINYGEMM_FLOPS, 1.5 + 4 * scales, 0.5 + 3 * scales)


HOST_KERNELS = {
    QuantFormat.INT8: KernelRoof("int8_host", 1.7, 1.4),  # int8_native_i8
    QuantFormat.INT4: KernelRoof("int4_host", 1.5, 1.0),  # int4_native_i8
    # dequantize-then-GEMM by the table gather (quant/mxfp4.py), in blocks of DEQUANT_CHUNK weights
    QuantFormat.MXFP4: KernelRoof("dequant_mm", 0.6, 18.0, 6.0, dequant_chunk("cpu")),
}


def measured(hw: HardwareProfile, scheme: QuantScheme) -> bool:
    """Whether `hw` measured the expert GEMM on pages of this format."""
    return hw.expert_format == scheme.key() and hw.expert_bandwidth > 0


def expert_kernels(
    hw: HardwareProfile, scheme: QuantScheme, b: int, page_bpw: float, on_device: bool
) -> tuple[KernelRoof, ...]:
    """The kernels the expert GEMM may run on one side. `b`: the model dtype's bytes; `page_bpw`: page
    bytes per weight (scales and zeros included); `on_device`: the side whose roofs are the profile's
    gpu_* (the device, or the host's experts when host and device are one)."""
    if on_device and measured(hw, scheme):
        flops = hw.expert_flops / hw.gpu_flops if hw.expert_flops else 1.0
        # the measured rate is in page bytes per second: as traffic at the dense bandwidth
        return (KernelRoof("measured", flops, page_bpw * hw.gpu_bandwidth / hw.expert_bandwidth),)
    if not scheme.quantized:
        return (KernelRoof("dense", 1.0, float(b)),)
    if not on_device or hw.shared_host_device:
        return (HOST_KERNELS[scheme.format],)
    kernels = [_dequant(scheme.format, b)]
    if scheme.format is QuantFormat.INT4 and hw.compute_capability >= TINYGEMM_MIN_CAPABILITY:
        kernels.append(_tinygemm(page_bpw))
    return tuple(kernels)
