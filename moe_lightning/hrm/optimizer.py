"""The policy search: the highest predicted decode throughput that fits both memories.

Search space (docs/design.md): attention on CPU or GPU, experts on GPU or CPU, micro-batch mu in
{1, 2, 3, 4, 32, 64, ...}, number of micro-batches n_ub (N = mu * n_ub), experts resident on the
device (whole experts per layer, 0..E), share of the KV cache on the device (attention on GPU).
Device memory grows (nearly) linearly with the resident experts and throughput never falls with
more of them, so the largest count that fits is solved in closed form instead of searched;
everything else is enumerated on a grid.

The grid's policies are costed by hrm/fastcost.py (estimate()'s numbers, bit for bit, without building
an Estimate each), and a point whose throughput ceiling provably loses to the best found so far is
skipped: it could not have replaced that best, so the result is the one trying every point gives.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from moe_lightning.hrm.costmodel import NO_QUANT, Estimate, Headroom, Policy, Workload, estimate
from moe_lightning.hrm.fastcost import Cost, PolicyCost
from moe_lightning.hrm.hardware import HardwareProfile
from moe_lightning.placement import Side
from moe_lightning.quant.scheme import QuantScheme
from moe_lightning.spec import ModelSpec

KV_GPU_FRACTIONS = (0.0, 0.5, 1.0)


def micro_batch_sizes(limit: int) -> list[int]:
    return [m for m in (1, 2, 3, 4, *range(32, limit + 1, 32)) if m <= limit]


def micro_batch_counts(limit: int) -> list[int]:
    """1..32 densely, then geometric steps of ~12 %: the throughput curve is smooth there."""
    out = list(range(1, min(limit, 32) + 1))
    x = 32.0
    while True:
        x *= 1.12
        if int(x) > limit:
            break
        if int(x) != out[-1]:
            out.append(int(x))
    if limit > 32 and out[-1] != limit:
        out.append(limit)
    return out


def _beats(tokens: float, batch: int, best: tuple[float, int] | None) -> bool:
    """Whether (tokens/s, batch) is better than `best`'s: same speed, the smaller batch (less memory,
    latency)."""
    if best is None:
        return True
    if not math.isclose(tokens, best[0], rel_tol=1e-9):
        return tokens > best[0]
    return batch < best[1]


def _better(a: Estimate, b: Estimate | None) -> bool:
    return _beats(a.tokens_per_second, a.policy.batch, None if b is None else (b.tokens_per_second, b.policy.batch))


def _cannot_beat(ceiling: float, batch: int, best: tuple[float, int] | None) -> bool:
    """Whether every policy at most `ceiling` tokens/s loses to `best`: below it and not within the
    tie tolerance (anything lower is further from it), or a tie at best with no smaller batch."""
    if best is None or not ceiling <= best[0]:
        return False
    return batch >= best[1] or not math.isclose(ceiling, best[0], rel_tol=1e-9)


def best_resident(
    cost: PolicyCost, n: int, mu: int, att_gpu: bool, exp_gpu: bool, r_c: float
) -> tuple[Cost, int] | None:
    """The resident count (with its cost) that is best among those that fit; memory is linear in it."""
    e, gpu_cap, cpu_cap = cost.total_experts, cost.gpu_capacity, cost.cpu_capacity
    low = cost(n, mu, att_gpu, exp_gpu, 0, r_c)
    if low[4] > cpu_cap:
        return None
    high = cost(n, mu, att_gpu, exp_gpu, e, r_c)
    slope = (high[3] - low[3]) / e
    if high[3] <= gpu_cap:
        if exp_gpu:
            return high, e
        j = e
    elif low[3] > gpu_cap:
        if slope >= 0:
            return None
        j = math.ceil((low[3] - gpu_cap) / -slope)
    else:
        j = e if slope <= 0 else int((gpu_cap - low[3]) / slope)
    j = max(0, min(e, j))
    # the double buffer shrinks in whole experts, so memory is only nearly linear: step down to a fit
    while j >= 0:
        top = cost(n, mu, att_gpu, exp_gpu, j, r_c)
        if top[3] <= gpu_cap and top[4] <= cpu_cap:
            break
        j -= 1
    else:
        return None
    if exp_gpu:
        return top, j
    # experts on the host: each resident expert moves work from the host to the device. Device time
    # rises and host time falls linearly with the count, so the layer time is V-shaped: the best
    # count is next to where the two lines cross, or at an end
    diff0, diff1 = low[1] - low[2], top[1] - top[2]
    cross = j * diff0 / (diff0 - diff1) if diff0 < 0 < diff1 else (0 if diff0 >= 0 else j)
    inner = {min(j, max(0, i)) for i in (math.floor(cross), math.ceil(cross))} - {0, j}
    tried = [(low, 0), (top, j), *((cost(n, mu, att_gpu, exp_gpu, i, r_c), i) for i in sorted(inner))]
    best = max(tried, key=lambda x: x[0][0])  # the first of the fastest
    return best if best[0][0] >= top[0] else (top, j)


def max_batch(
    spec: ModelSpec,
    work: Workload,
    hw: HardwareProfile,
    dtype: str | None,
    headroom: Headroom,
    cap: int,
    kv_dtype: str | None = None,
    quant: QuantScheme = NO_QUANT,
) -> int:
    """The largest N whose KV cache (in `kv_dtype`) and weights fit in host memory (attention on CPU), at
    most cap: with a 16-bit cache twice the sequences of an fp32 one."""
    probe = estimate(spec, work, hw, Policy(1, 1), dtype, headroom, kv_dtype, quant)
    per_seq = estimate(spec, work, hw, Policy(2, 1), dtype, headroom, kv_dtype, quant).cpu_bytes - probe.cpu_bytes
    room = probe.cpu_capacity - probe.cpu_bytes
    if room < 0:
        return 0
    return int(min(cap, 1 + room // max(per_seq, 1.0)))


def optimize(
    spec: ModelSpec,
    work: Workload,
    hw: HardwareProfile,
    dtype: str | None = None,
    headroom: Headroom = Headroom(),  # noqa: B008 (frozen)
    batch_cap: int = 8192,
    attention: Iterable[str] = ("cpu", "gpu"),
    experts: Iterable[str] = ("gpu", "cpu"),
    mus: Iterable[int] | None = None,
    n_ubs: Iterable[int] | None = None,
    resident: int | None = None,
    max_micro_batch: int | None = None,
    kv_dtype: str | None = None,
    quant: QuantScheme = NO_QUANT,
) -> Estimate:
    """The best fitting policy; raises ValueError when nothing fits (the message says why).

    `resident`: the running gpu_expert's resident expert count (it sized its residency within its
    own budget); the search then keeps it instead of choosing one.

    `max_micro_batch`: the most sequences one micro-batch may hold (the stack's hand-off slots carry
    that many tokens); the number of micro-batches is unbounded (the hand-off's flow control).

    `kv_dtype`: the host KV cache's dtype (default: the weights'); it decides how many sequences fit.

    `quant`: the format of the expert pages (default: the model dtype); smaller pages stream faster and
    leave room for more resident experts and a larger batch.

    `mus` / `n_ubs` replace the default grids (tests compare against brute force on small ones).
    """
    n_max = max_batch(spec, work, hw, dtype, headroom, batch_cap, kv_dtype, quant)
    if n_max < 1:
        raise ValueError(
            f"the weights alone ({spec.num_parameters() / 1e9:.1f} B parameters) do not fit in "
            f"{headroom.cpu:.0%} of host memory ({hw.cpu_memory / 1e9:.0f} GB)"
        )
    cost = PolicyCost(spec, work, hw, dtype, headroom, kv_dtype, quant)
    # Policy checks the names (and the count) as the grid points' policies did
    attention, experts = tuple(attention), tuple(experts)
    places = [Policy(1, 1, a, x, resident or 0) for a in attention for x in experts]
    best: tuple[float, int] | None = None  # tokens/s and batch of the best so far
    chosen: Policy | None = None
    mu_max = n_max if max_micro_batch is None else max(1, min(n_max, max_micro_batch))
    for mu in micro_batch_sizes(mu_max) if mus is None else [m for m in mus if m <= mu_max]:
        for n_ub in micro_batch_counts(n_max // mu) if n_ubs is None else [u for u in n_ubs if mu * u <= n_max]:
            n = mu * n_ub
            for place in places:
                att_gpu, exp_gpu = place.attention is Side.DEVICE, place.experts is Side.DEVICE
                for r_c in KV_GPU_FRACTIONS if att_gpu else (0.0,):
                    if resident is None:
                        # a point that provably loses to the best so far would not have replaced
                        # it: skipping it leaves the same best (the same sequence of bests)
                        if _cannot_beat(cost.ceiling(n, mu, att_gpu, exp_gpu, r_c), n, best):
                            continue
                        found = best_resident(cost, n, mu, att_gpu, exp_gpu, r_c)
                    else:  # one count, one estimate: nothing to save
                        point = cost(n, mu, att_gpu, exp_gpu, resident, r_c)
                        found = (point, resident) if point[4] <= cost.cpu_capacity else None
                    if found is not None and _beats(found[0][0], n, best):
                        best = (found[0][0], n)
                        chosen = Policy(n, mu, place.attention, place.experts, found[1], r_c)
    if chosen is None:
        raise ValueError("no policy fits: the dense weights and one micro-batch exceed device memory")
    return estimate(spec, work, hw, chosen, dtype, headroom, kv_dtype, quant)


def brute_force(
    spec: ModelSpec,
    work: Workload,
    hw: HardwareProfile,
    mus: Iterable[int],
    n_ubs: Iterable[int],
    dtype: str | None = None,
    headroom: Headroom = Headroom(),  # noqa: B008
    kv_dtype: str | None = None,
    quant: QuantScheme = NO_QUANT,
) -> Estimate | None:
    """Every policy on the given grid, every resident count: the reference the tests compare with."""
    best = None
    for mu in mus:
        for n_ub in n_ubs:
            for att in ("cpu", "gpu"):
                for exp in ("gpu", "cpu"):
                    for r_c in KV_GPU_FRACTIONS if att == "gpu" else (0.0,):
                        for j in range(spec.total_experts + 1):
                            est = estimate(
                                spec,
                                work,
                                hw,
                                Policy(mu * n_ub, mu, att, exp, j, r_c),
                                dtype,
                                headroom,
                                kv_dtype,
                                quant,
                            )
                            if est.fits and _better(est, best):
                                best = est
    return best
