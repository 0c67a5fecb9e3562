"""What a service measured of its side of the machine at warm-up, and the hardware profile the
planner makes of the two sides. Apart from calibrate.py, which measures with torch: the orchestrator
plans from these without importing torch (it computes nothing; a stack starts faster without a fourth
import of it)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from moe_lightning.hrm.hardware import HardwareProfile


@dataclass(frozen=True, slots=True)
class Measurements:
    """What one service measured at warm-up; the planner combines the two sides into a profile."""

    matmul_flops: float = 0.0
    weight_stream_bandwidth: float = 0.0
    attention_bandwidth: float = 0.0
    memory_bytes: float = 0.0
    h2d_bandwidth: float = 0.0
    d2h_bandwidth: float = 0.0
    shared_host_device: bool = False
    source: str = ""
    # gpu_expert with quantized expert pages: their format (QuantScheme.key()), the expert GEMM's
    # FLOP/s and the page bytes per second it reads, both through the kernels chosen for the pages.
    # weight_stream_bandwidth is then the dense weights' rate (unquantized: the experts' own)
    expert_format: str = "none"
    expert_matmul_flops: float = 0.0
    expert_stream_bandwidth: float = 0.0
    # gpu_expert on a CPU device with --link-bandwidth: h2d/d2h are that simulated link's rate
    simulated_link: bool = False
    # gpu_expert: the host's time to issue a layer's launches (HardwareProfile's fields of the same
    # names, hrm/host_issue.py); 0 from a peer that does not measure them
    host_micro_batch_seconds: float = 0.0
    host_ffn_seconds: float = 0.0
    host_expert_seconds: float = 0.0


def simulated_link(m: Measurements, bandwidth: float) -> Measurements:
    """A CPU device's measurements behind a simulated link of `bandwidth` bytes/s: the planner then sees
    that link, as it would see a GPU's measured one."""
    return replace(m, h2d_bandwidth=bandwidth, d2h_bandwidth=bandwidth, simulated_link=True)


def profile_from(expert: Measurements, attention: Measurements, name: str = "calibrated-stack") -> HardwareProfile:
    return HardwareProfile(
        name=name,
        gpu_flops=expert.matmul_flops,
        gpu_bandwidth=expert.weight_stream_bandwidth,
        gpu_memory=expert.memory_bytes,
        cpu_flops=attention.matmul_flops,
        cpu_bandwidth=attention.attention_bandwidth,
        cpu_memory=attention.memory_bytes,
        h2d_bandwidth=expert.h2d_bandwidth,
        d2h_bandwidth=expert.d2h_bandwidth,
        shared_host_device=expert.shared_host_device,
        simulated_link=expert.simulated_link,
        source="calibrated by the services",
        expert_format=expert.expert_format or "none",  # a peer without the field sent ""
        expert_flops=expert.expert_matmul_flops,
        expert_bandwidth=expert.expert_stream_bandwidth,
        host_micro_batch_seconds=expert.host_micro_batch_seconds,
        host_ffn_seconds=expert.host_ffn_seconds,
        host_expert_seconds=expert.host_expert_seconds,
    )
