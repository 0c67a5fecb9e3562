"""The device budget: the smallest --device-memory at which gpu_expert's own residency plan keeps a
given share of the experts resident, and the room the stack needs in /dev/shm. Capped (the main
comparison's runs: gpu_expert --cap-device-memory), the budget bounds everything ours allocates on the
device, as the offload baseline's total is bounded, so it also holds the activations' room."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_lightning.config.units import format_size
from moe_lightning.spec import ModelSpec

# Besides the weight arena, /dev/shm holds cpu_attention's KV cache (run_batch sizes it from the batch:
# moe_lightning.benchmark.kv_cache_bytes) and the two hand-off channels (4 slots each of the services'
# default 8192 tokens per hand-off).
HANDOFF_SLOTS, HANDOFF_TOKENS = 4, 8192
CHECK_PROMPTS, CHECK_GEN = 64, 32  # the check's default workload (gpu_check.py --num-prompts, --gen-len)
MAX_PREFILL_TOKENS = 8192  # the orchestrator's --max-prefill-tokens default, which the check's stacks run with


@dataclass(frozen=True, slots=True)
class Budget:
    device_memory: int  # what --device-memory gets
    dense_bytes: int
    expert_bytes: int  # one expert (w13 + w2)
    resident_experts: int  # what gpu_expert's plan keeps on the device at this budget
    total_experts: int
    ring_bytes: int  # the streaming buffers
    arena_bytes: int  # the whole weight arena in /dev/shm
    reserve_bytes: int = 0  # capped: the activations' and workspace's room within device_memory

    @property
    def resident_fraction(self) -> float:
        return self.resident_experts / self.total_experts


def device_budget(spec: ModelSpec, dtype: str, resident_fraction: float, capped: bool = False) -> Budget:
    """The smallest budget at which gpu_expert's own residency plan keeps at least `resident_fraction`
    of the experts on the device, besides the dense weights and its streaming buffers; `capped`: the
    budget holds everything gpu_expert allocates (--cap-device-memory), so the room it keeps back for
    activations (at the hand-off's most tokens) and workspace is added.

    Sizes are computed as gpu_expert computes them (the arena layout), and the plan is gpu_expert's
    `plan_residency`, so the rule follows the ring's sizing as it changes. The plan only moves at
    whole experts, so half an expert of margin absorbs small accounting differences without
    changing the plan.
    """
    from moe_lightning.arena import ArenaLayout, expert_page_names
    from moe_lightning.config.checks import DeviceBudgetError
    from moe_lightning.hrm.sizes import DTYPE_BYTES
    from services.gpu_expert.memory import capped_reserve
    from services.gpu_expert.residency import plan_residency

    layout = ArenaLayout.for_spec(spec, dtype)
    w13, w2 = (layout.pages[n] for n in expert_page_names(spec.experts_per_layer.index(spec.num_experts), 0))
    expert = w13.nbytes + w2.nbytes
    total = spec.total_experts
    dense = layout.total_bytes - total * expert
    target = round(resident_fraction * total)
    reserve = capped_reserve(spec, HANDOFF_TOKENS, int(DTYPE_BYTES[dtype])) if capped else 0
    for slots in range(total + 1):  # at slots == total everything fits, so this always returns
        try:
            plan = plan_residency(
                spec.num_layers, spec.num_experts, expert, dense, dense + slots * expert, dense_layers=spec.dense_layers
            )
        except DeviceBudgetError:
            continue
        resident = sum(len(r) for r in plan.resident)
        if resident >= target:
            ring = plan.device_bytes - dense - resident * expert
            weights = dense + slots * expert + expert // 2
            return Budget(weights + reserve, dense, expert, resident, total, ring, layout.total_bytes, reserve)
    raise AssertionError("unreachable: the whole model fits at slots == total")


def kv_needed(spec: ModelSpec, prompts: int = CHECK_PROMPTS, gen: int = CHECK_GEN, kv_dtype: str = "bfloat16") -> int:
    """The KV cache run_batch gives the check's workload (`moe-lightning bench --workload mtbench`'s
    prompts; cpu_attention's KV in the arena's dtype): the same function, the same number."""
    from moe_lightning.benchmark import kv_cache_bytes, mtbench_lengths

    return kv_cache_bytes(spec, mtbench_lengths(prompts), gen, kv_dtype)


def shm_needed(
    spec: ModelSpec, budget: Budget, prompts: int = CHECK_PROMPTS, gen: int = CHECK_GEN, kv_dtype: str = "bfloat16"
) -> int:
    """Bytes one stack keeps in /dev/shm (the stacks of a bench run one after the other)."""
    from moe_lightning.handoff import handoff_slot_bytes
    from moe_lightning.torch_dtypes import DTYPES

    act = DTYPES[kv_dtype]  # the arena's dtype, which gpu_expert computes in
    channels = HANDOFF_SLOTS * sum(handoff_slot_bytes(spec, HANDOFF_TOKENS, kind, act) for kind in ("qkv", "attn"))
    kv = kv_needed(spec, prompts, gen, kv_dtype)
    return budget.arena_bytes + kv + channels + (256 << 20)  # + slack for small segments


def layers_that_fit(
    preset: dict[str, Any],
    dtype: str,
    resident_fraction: float,
    shm_free: int,
    prompts: int = CHECK_PROMPTS,
    gen: int = CHECK_GEN,
) -> int:
    """The most layers of `preset` (a config) whose arena, KV cache and channels fit in /dev/shm."""
    from moe_lightning.demo_model import mixtral_config

    for layers in range(preset["num_hidden_layers"], 0, -1):
        spec = ModelSpec.from_hf_config(mixtral_config({**preset, "num_hidden_layers": layers}, "bfloat16"))
        if shm_needed(spec, device_budget(spec, dtype, resident_fraction), prompts, gen, dtype) <= shm_free:
            return layers
    return 0


def describe_budget(b: Budget) -> str:
    size = format_size
    reserve = f" + {size(b.reserve_bytes)} for activations and workspace (capped)" if b.reserve_bytes else ""
    return (
        f"--device-memory {b.device_memory} ({size(b.device_memory)}) = dense {size(b.dense_bytes)}"
        f" + ring {size(b.ring_bytes)} ({b.ring_bytes // b.expert_bytes} experts)"
        f" + {b.resident_experts} of {b.total_experts} experts resident ({b.resident_fraction:.0%},"
        f" {size(b.resident_experts * b.expert_bytes)}) + {size(b.expert_bytes // 2)} margin{reserve}"
    )
