"""The HRM's view of a CPU-only machine (the host is the device) with round roofs, and the bench
demo model's spec: what the planner and timing-comparison tests predict against."""

from __future__ import annotations

from moe_lightning.demo_model import mixtral_config
from moe_lightning.hrm.hardware import HardwareProfile
from moe_lightning.spec import ModelSpec

SPEC = ModelSpec.from_hf_config(mixtral_config("bench"))
HOST = HardwareProfile(
    "host",
    gpu_flops=1e11,
    gpu_bandwidth=3e9,
    gpu_memory=24e9,
    cpu_flops=1e11,
    cpu_bandwidth=2e9,
    cpu_memory=24e9,
    h2d_bandwidth=1e10,
    d2h_bandwidth=1e10,
    shared_host_device=True,
)
