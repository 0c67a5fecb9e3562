"""A policy (what the HRM chooses), its verdict (Estimate) and estimate(), the verdict on one
policy. The formula itself, shared with the search, and its inputs (Workload, Headroom) are
hrm/layercost.py's.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from moe_lightning.hrm.hardware import HardwareProfile
from moe_lightning.hrm.layercost import EXPECTED_USE, NO_QUANT, CostModel, Headroom, Workload
from moe_lightning.placement import Placement, Side
from moe_lightning.quant.scheme import QuantScheme
from moe_lightning.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class Policy:
    batch: int  # N sequences decoded per step
    micro_batch_size: int  # mu sequences per micro-batch
    attention: Side = Side.HOST  # where attention runs ("cpu" / "gpu" accepted)
    experts: Side = Side.DEVICE  # where non-resident expert FFNs run
    resident_experts: int = 0  # (layer, expert) pages kept on the device, of L * E (r_w = this / (L * E))
    kv_gpu_fraction: float = 0.0  # r_c: share of the KV cache on the device (attention on GPU)
    # groups of micro-batches whose layer FFN runs at once, each touched expert read once a group
    # (services/gpu_expert/schedule.py group_bounds); 0: once per micro-batch, CGOPipe's own order
    expert_groups: int = 0

    def __post_init__(self) -> None:
        if self.batch < 1 or self.micro_batch_size < 1 or self.batch % self.micro_batch_size:
            mu = self.micro_batch_size
            raise ValueError(f"batch ({self.batch}) must be a positive multiple of micro_batch_size ({mu})")
        sides = tuple(Side)
        if self.attention not in sides or self.experts not in sides:
            raise ValueError(f"attention and experts must be one of {', '.join(sides)}")
        object.__setattr__(self, "attention", Side(self.attention))
        object.__setattr__(self, "experts", Side(self.experts))
        if not 0.0 <= self.kv_gpu_fraction <= 1.0 or self.resident_experts < 0:
            raise ValueError("kv_gpu_fraction in [0, 1], resident_experts >= 0")
        groups = self.expert_groups
        if isinstance(groups, bool) or not isinstance(groups, numbers.Integral) or groups < 0:
            raise ValueError(f"expert_groups must be a whole number >= 0 (0: once per micro-batch), got {groups!r}")
        object.__setattr__(self, "expert_groups", int(groups))  # a numpy count too, compared as an int

    @property
    def num_micro_batches(self) -> int:
        return self.batch // self.micro_batch_size

    @property
    def effective_expert_groups(self) -> int:
        """How many FFN passes a layer makes: n_ub once per micro-batch (0, or n_ub groups or more)."""
        n_ub = self.num_micro_batches
        return min(self.expert_groups, n_ub) if self.expert_groups else n_ub

    @property
    def placement(self) -> Placement:
        return Placement(self.attention, self.experts)


@dataclass(frozen=True, slots=True)
class Estimate:
    policy: Policy
    stage_seconds: dict[str, float]  # per layer: what each resource spends, by stage
    resource_seconds: dict[str, float]  # per layer: gpu, cpu, link (each resource's total)
    layer_seconds: float
    tokens_per_second: float
    gpu_bytes: float
    cpu_bytes: float
    gpu_capacity: float
    cpu_capacity: float
    binding: str  # the resource with the largest time
    stage_work: dict[str, tuple[float, float]] = field(default_factory=dict)  # (flops, bytes) per layer
    kv_host_bytes: float = 0.0  # the part of cpu_bytes that is the host KV cache (in its own dtype)
    quant: QuantScheme = NO_QUANT  # the expert pages' format
    page_bytes: float = 0.0  # one expert page (w13 + w2) in that format
    link_bytes: dict[str, float] = field(default_factory=dict)  # per layer, per link stage
    kernels: dict[str, str] = field(default_factory=dict)  # expert stage -> the kernel the model assumed
    kv_rule: str = EXPECTED_USE  # how the KV of the batch was counted (layercost.kv_tokens)
    kv_format: str = ""  # the host KV cache's format
    # per layer: the device's stages alone, and the host's time to issue them (hrm/host_issue.py);
    # resource_seconds["gpu"] is the larger of the two on a GPU, their sum on a CPU device
    gpu_compute_seconds: float = 0.0
    issue_seconds: float = 0.0
    shared_host_device: bool = False  # the device is the host's cores: the issue time adds to compute

    @property
    def fits(self) -> bool:
        return self.gpu_bytes <= self.gpu_capacity and self.cpu_bytes <= self.cpu_capacity


def estimate(
    spec: ModelSpec,
    work: Workload,
    hw: HardwareProfile,
    policy: Policy,
    dtype: str | None = None,
    headroom: Headroom = Headroom(),
    kv_dtype: str | None = None,
    quant: QuantScheme = NO_QUANT,
    overlap: bool = True,
    kv_rule: str = EXPECTED_USE,
) -> Estimate:
    """`dtype`: the weights' (default the spec's), also the device KV cache's; `kv_dtype`: the host KV
    cache's format (cpu_attention's --kv-dtype, int8 included; default the weights'); `quant`: the
    expert pages' format. `overlap=False`: the overlap-off baseline schedule (gpu_expert --no-overlap:
    every stage waits for the one before, a layer's experts copied when it starts), where the
    resources' times add up and the policy's expert_groups do not apply. `kv_rule`: "expected" (KV
    taken as sequences grow) or "max" (reserved at the maximum context, the paper's rule), what the
    batch's KV costs in memory (layercost.kv_tokens).
    Raises ValueError for a dtype that is not resolved ('auto')."""
    model = CostModel(spec, work, hw, dtype, headroom, kv_dtype, quant, kv_rule)
    cost = model.layer(
        policy.batch,
        policy.micro_batch_size,
        policy.attention is Side.DEVICE,
        policy.experts is Side.DEVICE,
        policy.resident_experts,
        policy.kv_gpu_fraction,
        overlap,
        policy.expert_groups,
    )
    # scalars in, Python numbers out (layercost.py): the policy's stages only
    seconds: dict[str, float] = {}
    stage_work: dict[str, tuple[float, float]] = {}
    link_bytes: dict[str, float] = {}
    for name, stage in cost.stages.items():
        if stage.present:
            seconds[name] = stage.seconds
            if stage.work is not None:
                stage_work[name] = stage.work
            if stage.link_bytes is not None:
                link_bytes[name] = stage.link_bytes
    resources = {"gpu": cost.gpu, "cpu": cost.cpu, "link": cost.link}
    return Estimate(
        policy=policy,
        stage_seconds=seconds,
        resource_seconds=resources,
        layer_seconds=cost.layer,
        tokens_per_second=cost.tokens,
        gpu_bytes=cost.gpu_bytes,
        cpu_bytes=cost.cpu_bytes,
        gpu_capacity=model.gpu_capacity,
        cpu_capacity=model.cpu_capacity,
        binding=max(resources, key=lambda r: resources[r]),  # the first of the slowest
        stage_work=stage_work,
        kv_host_bytes=cost.kv_host_bytes,
        quant=quant,
        page_bytes=model.w["expert"],
        link_bytes=link_bytes,
        kernels={name: model.kernels[name][index].name for name, index in cost.kernels.items() if name in seconds},
        kv_rule=model.kv_rule,
        kv_format=model.kv_format,
        gpu_compute_seconds=cost.gpu_compute,
        issue_seconds=cost.issue,
        shared_host_device=hw.shared_host_device,
    )
