"""The policy search one policy at a time: every grid point through estimate(), no point skipped, as
it was before the optimizer costed whole grids on arrays. The optimizer must return exactly what this
returns (tests/test_hrm_search.py)."""

from __future__ import annotations

import math
from collections.abc import Iterable

from moe_lightning.config.choices import EXPERT_GROUP_CHOICES
from moe_lightning.demo_model import mixtral_config
from moe_lightning.hrm.costmodel import Estimate, Policy, estimate
from moe_lightning.hrm.hardware import HardwareProfile
from moe_lightning.hrm.layercost import NO_QUANT, Headroom, Workload
from moe_lightning.hrm.optimizer import KV_GPU_FRACTIONS, max_batch, micro_batch_counts, micro_batch_sizes
from moe_lightning.quant.scheme import QuantScheme
from moe_lightning.spec import ModelSpec

SMALL = ModelSpec.from_hf_config(mixtral_config("tiny"))  # 2 layers x 4 experts: brute force is cheap
# A machine scaled to SMALL so that both memories and all three roofs matter.
TOY = HardwareProfile(
    "toy",
    gpu_flops=2e9,
    gpu_bandwidth=4e9,
    gpu_memory=3.0e6,
    cpu_flops=4e8,
    cpu_bandwidth=1e9,
    cpu_memory=40e6,
    h2d_bandwidth=2e8,
    d2h_bandwidth=2e8,
)


def _better(a: Estimate, b: Estimate | None) -> bool:
    if b is None:
        return True
    if not math.isclose(a.tokens_per_second, b.tokens_per_second, rel_tol=1e-9):
        return a.tokens_per_second > b.tokens_per_second
    return a.policy.batch < b.policy.batch  # same speed: the smaller batch (less memory, latency)


def best_resident(
    spec: ModelSpec,
    work: Workload,
    hw: HardwareProfile,
    base: Policy,
    dtype: str | None,
    headroom: Headroom,
    kv_dtype: str | None = None,
    quant: QuantScheme = NO_QUANT,
) -> Estimate | None:
    """The policy with the most resident experts that fits (memory is linear in that count)."""
    from dataclasses import replace

    e = spec.total_experts
    low = estimate(spec, work, hw, replace(base, resident_experts=0), dtype, headroom, kv_dtype, quant)
    if low.cpu_bytes > low.cpu_capacity:
        return None
    high = estimate(spec, work, hw, replace(base, resident_experts=e), dtype, headroom, kv_dtype, quant)
    slope = (high.gpu_bytes - low.gpu_bytes) / e
    if high.gpu_bytes <= high.gpu_capacity:
        if base.experts == "gpu":
            return high
        j = e
    elif low.gpu_bytes > low.gpu_capacity:
        if slope >= 0:
            return None
        j = math.ceil((low.gpu_bytes - low.gpu_capacity) / -slope)
    else:
        j = e if slope <= 0 else int((low.gpu_capacity - low.gpu_bytes) / slope)
    j = max(0, min(e, j))
    # the double buffer shrinks in whole experts, so memory is only nearly linear: step down to a fit
    while j >= 0:
        est = estimate(spec, work, hw, replace(base, resident_experts=j), dtype, headroom, kv_dtype, quant)
        if est.fits:
            break
        j -= 1
    else:
        return None
    if base.experts == "gpu":
        return est
    # experts on the host: each resident expert moves work from the host to the device. Device time
    # rises and host time falls linearly with the count, so the layer time is V-shaped: the best
    # count is next to where the two lines cross, or at an end

    def at(i: int) -> Estimate:
        return estimate(spec, work, hw, replace(base, resident_experts=i), dtype, headroom, kv_dtype, quant)

    top = est if j == est.policy.resident_experts else at(j)

    def crossing(diff0: float, diff1: float) -> float:
        return j * diff0 / (diff0 - diff1) if diff0 < 0 < diff1 else (0 if diff0 >= 0 else j)

    cpu0, cpu1 = low.resource_seconds["cpu"], top.resource_seconds["cpu"]
    if hw.shared_host_device:  # the host's issue time adds to the device's compute: one line
        corners = [crossing(low.resource_seconds["gpu"] - cpu0, top.resource_seconds["gpu"] - cpu1)]
    else:  # the device's time is max(compute, issue): the host's line meets the first; compute passes issue
        issue, c0, c1 = low.issue_seconds, low.gpu_compute_seconds, top.gpu_compute_seconds
        cross = crossing(c0 - cpu0, c1 - cpu1)
        corners = (
            [min(cross, crossing(issue - cpu0, issue - cpu1)), crossing(c0 - issue, c1 - issue)]
            if issue > 0
            else [cross]
        )
    inner = {min(j, max(0, i)) for c in corners for i in (math.floor(c), math.ceil(c))} - {0, j}
    best = max([low, top, *(at(i) for i in sorted(inner))], key=lambda x: x.tokens_per_second)
    return best if best.tokens_per_second >= est.tokens_per_second else est


def exhaustive(
    spec: ModelSpec,
    work: Workload,
    hw: HardwareProfile,
    dtype: str | None = None,
    headroom: Headroom = Headroom(),
    batch_cap: int = 8192,
    attention: Iterable[str] = ("cpu", "gpu"),
    experts: Iterable[str] = ("gpu", "cpu"),
    mus: Iterable[int] | None = None,
    n_ubs: Iterable[int] | None = None,
    resident: int | None = None,
    max_micro_batch: int | None = None,
    kv_dtype: str | None = None,
    quant: QuantScheme = NO_QUANT,
    expert_groups: Iterable[int] = EXPERT_GROUP_CHOICES,
) -> Estimate:
    """optimize() before it skipped points: the best fitting policy; ValueError when nothing fits.

    `resident`: the running gpu_expert's resident expert count (it sized its residency within its
    own budget); the search then keeps it instead of choosing one.

    `max_micro_batch`: the most sequences one micro-batch may hold (the stack's hand-off slots carry
    that many tokens); the number of micro-batches is unbounded (the hand-off's flow control).

    `kv_dtype`: the host KV cache's dtype (default: the weights'); it decides how many sequences fit.

    `quant`: the format of the expert pages (default: the model dtype); smaller pages stream faster and
    leave room for more resident experts and a larger batch.

    `expert_groups`: the schedules of a layer's experts, as optimize() searches them (each choice's best,
    a later one kept only when faster beyond a tie; a group larger than `max_micro_batch` is not run).

    `mus` / `n_ubs` replace the default grids (tests compare against brute force on small ones).
    """
    n_max = max_batch(spec, work, hw, dtype, headroom, batch_cap, kv_dtype, quant)
    if n_max < 1:
        raise ValueError(
            f"the weights alone ({spec.num_parameters() / 1e9:.1f} B parameters) do not fit in "
            f"{headroom.cpu:.0%} of host memory ({hw.cpu_memory / 1e9:.0f} GB)"
        )
    winner: Estimate | None = None
    attention, experts = tuple(attention), tuple(experts)
    mu_max = n_max if max_micro_batch is None else max(1, min(n_max, max_micro_batch))
    for choice in expert_groups:  # a later choice's best wins only when faster beyond a tie
        best: Estimate | None = None
        for mu in micro_batch_sizes(mu_max) if mus is None else [m for m in mus if m <= mu_max]:
            for n_ub in micro_batch_counts(n_max // mu) if n_ubs is None else [u for u in n_ubs if mu * u <= n_max]:
                groups = choice if 0 < choice < n_ub else 0  # as many groups as micro-batches: the same schedule
                if groups and max_micro_batch is not None and -(-n_ub // groups) * mu > max(max_micro_batch, 1):
                    continue  # gpu_expert would split such a group
                for att in attention:
                    for exp in experts:
                        for r_c in KV_GPU_FRACTIONS if att == "gpu" else (0.0,):
                            base = Policy(mu * n_ub, mu, att, exp, resident or 0, r_c, groups)
                            if resident is None:
                                est = best_resident(spec, work, hw, base, dtype, headroom, kv_dtype, quant)
                            else:
                                est = estimate(spec, work, hw, base, dtype, headroom, kv_dtype, quant)
                                est = est if est.cpu_bytes <= est.cpu_capacity else None
                            if est is not None and _better(est, best):
                                best = est
        if best is not None and (
            winner is None
            or (
                best.tokens_per_second > winner.tokens_per_second
                and not math.isclose(best.tokens_per_second, winner.tokens_per_second, rel_tol=1e-9)
            )
        ):
            winner = best
    best = winner
    if best is None:
        raise ValueError("no policy fits: the dense weights and one micro-batch exceed device memory")
    return best
