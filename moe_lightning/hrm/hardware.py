"""Hardware profiles: the roofs the cost model needs, from presets or a JSON file.

Presets: t4 and l4 carry the MoE-Lightning reference code's constants (T4: 15 GB usable,
300 GB/s, 65 TFLOP/s fp16; L4: 24 GB, 300 GB/s, 104 TFLOP/s; PCIe 16 GB/s; the paper's hosts:
CPU DRAM ~100 GB/s, ~1.6 TFLOP/s, 192 GB). The others use datasheet numbers (dense fp16/bf16 tensor
FLOP/s, HBM bandwidth, capacity) with a PCIe Gen4 (a100) or Gen5 (h100, h200) x16 link at ~80 % of
its raw rate, and a 2-socket server host.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

GB = 1e9
TFLOPS = 1e12
HOST_ISSUE_FIELDS = ("host_micro_batch_seconds", "host_ffn_seconds", "host_expert_seconds")


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    name: str
    gpu_flops: float  # peak matmul FLOP/s in the serving dtype (per GPU)
    gpu_bandwidth: float  # device memory bytes/s (per GPU)
    gpu_memory: float  # device memory bytes (per GPU)
    cpu_flops: float  # host FLOP/s for attention / CPU experts
    cpu_bandwidth: float  # host DRAM bytes/s
    cpu_memory: float  # host memory bytes
    h2d_bandwidth: float  # host -> device bytes/s (pinned, per GPU)
    d2h_bandwidth: float  # device -> host bytes/s (per GPU)
    shared_host_device: bool = False  # the "device" is the host itself (CPU-only run): no overlap, no link
    # a CPU "device" whose expert streaming is capped at h2d_bandwidth (gpu_expert --link-bandwidth):
    # the link is then a resource of its own that overlaps compute, while compute still shares the cores
    # (docs/cgopipe-and-benchmarks.md, "The link on the CPU")
    simulated_link: bool = False
    source: str = "preset"
    # CUDA compute capability (7.5 T4, 8.9 L4, ...): which quantized expert kernels the device has
    # (int4 tinygemm needs 8.0+); 0 when unknown, then only dequantize-then-GEMM is assumed
    compute_capability: float = 0.0
    # The expert GEMM's own roofs, measured on expert pages of `expert_format` (QuantScheme.key())
    # through the kernels the services chose: FLOP/s and page bytes read per second. 0: derive them
    # from gpu_flops / gpu_bandwidth and the kernel table in hrm/kernels.py
    expert_format: str = "none"
    expert_flops: float = 0.0
    expert_bandwidth: float = 0.0
    # Seconds of host time to issue one layer's decode work on the device (hrm/host_issue.py): a
    # micro-batch's per-token stages (pre-attention, hand-off, attention output), an FFN pass's fixed
    # part (router, token sort, the sync on the counts: once per micro-batch, or per group of them) and
    # each expert the pass computes. The device cannot finish a layer before the host has issued it
    # (hrm/layercost.py). 0: not modelled (profiles written before these existed load so)
    host_micro_batch_seconds: float = 0.0
    host_ffn_seconds: float = 0.0
    host_expert_seconds: float = 0.0

    def __post_init__(self) -> None:
        for field in (
            "gpu_flops",
            "gpu_bandwidth",
            "gpu_memory",
            "cpu_flops",
            "cpu_bandwidth",
            "cpu_memory",
            "h2d_bandwidth",
            "d2h_bandwidth",
        ):
            if not getattr(self, field) > 0:
                raise ValueError(f"hardware profile {self.name!r}: {field} must be positive")
        if self.expert_flops < 0 or self.expert_bandwidth < 0:
            raise ValueError(f"hardware profile {self.name!r}: expert roofs must not be negative")
        for field in HOST_ISSUE_FIELDS:
            if not 0 <= getattr(self, field) < math.inf:
                raise ValueError(f"hardware profile {self.name!r}: {field} must be finite and not negative")

    def host_issue_seconds(self, experts: float) -> float:
        """Host time to issue one micro-batch of one layer that runs its own FFN pass over `experts`
        experts (CGOPipe's order; with expert groups the pass is a group's, layercost.py)."""
        return self.host_micro_batch_seconds + self.host_ffn_seconds + experts * self.host_expert_seconds

    def scaled(self, **factors: float) -> HardwareProfile:
        """A copy with some roofs multiplied (for calibration corrections and what-if tests)."""
        return replace(self, **{k: getattr(self, k) * v for k, v in factors.items()})

    def with_gpus(self, n: int) -> HardwareProfile:
        """n GPUs in tensor parallel: per-GPU roofs and capacities add up (each GPU has its own link).
        The host terms stay: each rank's process issues its own shard's launches, as many, alongside."""
        if n < 1:
            raise ValueError(f"--gpus must be >= 1, got {n}")
        if n == 1:
            return self
        p = self.scaled(
            gpu_flops=n,
            gpu_bandwidth=n,
            gpu_memory=n,
            h2d_bandwidth=n,
            d2h_bandwidth=n,
            expert_flops=n,
            expert_bandwidth=n,
        )
        return replace(p, name=f"{n}x{self.name}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_file(cls, path: str | Path) -> HardwareProfile:
        try:
            data = json.loads(Path(path).read_text())
            return cls(**{**data, "source": str(path)})
        except (OSError, json.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"{path}: not a hardware profile ({exc})") from exc


def with_simulated_link(profile: HardwareProfile, bandwidth: float) -> HardwareProfile:
    """A CPU-only profile whose expert pages stream over a simulated link of `bandwidth` bytes/s
    (gpu_expert --link-bandwidth): the figure the services' planner uses as the link's."""
    if not profile.shared_host_device:
        raise ValueError(f"{profile.name}: a simulated link is for a CPU device; a GPU profile has its real link")
    return replace(profile, h2d_bandwidth=bandwidth, d2h_bandwidth=bandwidth, simulated_link=True)


# The presets' host issue terms, where no measurement is: what one layer of a Mixtral decode issues,
# counted in PyTorch calls (aten ops, a dispatch mode around the stages of hrm/host_issue.py in bf16),
# times what a call costs the host. Per micro-batch ~64 calls (pre-attention 45, hand-off ~8, attention
# output 11), per FFN pass ~24 (router, top-k, sort, counts) and one sync, per expert ~14 (its token
# slice, two GEMMs, SiLU, product, weighted index_add; ~8 of them launch kernels). A PyTorch eager op
# costs ~5-10 us of host time to launch a kernel on a server CPU, a view ~1-2 us: ~5 us a call on
# average (about 60 % launch), and ~20 us for the sync (a read of a few bytes back to the host, the
# launch queue drained). A micro-batch touching all 8 experts: 0.32 + 0.14 + 8 x 0.07 = 1.02 ms.
HOST_CALL_SECONDS, HOST_SYNC_SECONDS = 5e-6, 20e-6
HOST_CALLS = {"micro_batch": 64, "ffn": 24, "expert": 14}
PRESET_HOST_ISSUE = {
    "host_micro_batch_seconds": HOST_CALLS["micro_batch"] * HOST_CALL_SECONDS,
    "host_ffn_seconds": HOST_CALLS["ffn"] * HOST_CALL_SECONDS + HOST_SYNC_SECONDS,
    "host_expert_seconds": HOST_CALLS["expert"] * HOST_CALL_SECONDS,
}


def _host(memory_gb: float, bandwidth_gbs: float, tflops: float) -> dict[str, float]:
    """The host's roofs and its issue terms (the same assumed server CPU for every preset)."""
    roofs = {"cpu_memory": memory_gb * GB, "cpu_bandwidth": bandwidth_gbs * GB, "cpu_flops": tflops * TFLOPS}
    return {**roofs, **PRESET_HOST_ISSUE}


PRESETS: dict[str, HardwareProfile] = {
    # The reference code's constants (docs/design.md): usable memory, HBM, fp16 peak, PCIe 16 GB/s.
    "t4": HardwareProfile(
        "t4",
        65 * TFLOPS,
        300 * GB,
        15 * GB,
        **_host(192, 100, 1.6),
        h2d_bandwidth=16 * GB,
        d2h_bandwidth=16 * GB,
        compute_capability=7.5,
    ),
    "l4": HardwareProfile(
        "l4",
        104 * TFLOPS,
        300 * GB,
        24 * GB,
        **_host(192, 100, 1.6),
        h2d_bandwidth=16 * GB,
        d2h_bandwidth=16 * GB,
        compute_capability=8.9,
    ),
    # Datasheets: A100 40GB SXM 312 TFLOP/s bf16, 1555 GB/s; H100 SXM 989, 3350 GB/s, 80 GB;
    # H200 989, 4800 GB/s, 141 GB. Links at ~80 % of PCIe Gen4 (32 GB/s) / Gen5 (64 GB/s) x16.
    "a100-40g": HardwareProfile(
        "a100-40g",
        312 * TFLOPS,
        1555 * GB,
        40 * GB,
        **_host(512, 200, 3.0),
        h2d_bandwidth=25 * GB,
        d2h_bandwidth=25 * GB,
        compute_capability=8.0,
    ),
    "h100": HardwareProfile(
        "h100",
        989 * TFLOPS,
        3350 * GB,
        80 * GB,
        **_host(1024, 300, 5.0),
        h2d_bandwidth=50 * GB,
        d2h_bandwidth=50 * GB,
        compute_capability=9.0,
    ),
    "h200": HardwareProfile(
        "h200",
        989 * TFLOPS,
        4800 * GB,
        141 * GB,
        **_host(1024, 300, 5.0),
        h2d_bandwidth=50 * GB,
        d2h_bandwidth=50 * GB,
        compute_capability=9.0,
    ),
}


def load_profile(name_or_path: str) -> HardwareProfile:
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if Path(name_or_path).is_file():
        return HardwareProfile.from_file(name_or_path)
    raise ValueError(f"unknown hardware {name_or_path!r}: use one of {', '.join(PRESETS)} or a profile JSON file")
