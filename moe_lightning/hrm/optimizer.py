"""The policy search: the highest predicted decode throughput that fits both memories.

Search space (docs/design.md): attention on CPU or GPU, experts on GPU or CPU, micro-batch mu in
{1, 2, 3, 4, 32, 64, ...}, number of micro-batches n_ub (N = mu * n_ub), experts resident on the
device (whole experts per layer, 0..E), share of the KV cache on the device (attention on GPU), and
how many groups of micro-batches run a layer's experts at once (`expert_groups`: the choices given).
Device memory grows (nearly) linearly with the resident experts and throughput never falls with
more of them, so the largest count that fits is solved in closed form instead of searched (hrm/resident.py);
everything else is enumerated on a grid.

The whole grid is costed at once, by hrm/layercost.py's formula on arrays: the code estimate() runs
for one policy, so each point's numbers are estimate()'s and the plan is the one trying every point
through estimate() returns (tests/hrm_reference.py). Only the choice among the points' bests is a
loop: it breaks ties in throughput with a relative tolerance, which does not order the points.
Each expert-group choice is searched on its own grid; a later choice replaces an earlier one's best
only when it is faster beyond that tolerance, so a tie keeps the first (per micro-batch, by default).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from moe_lightning.config.choices import EXPERT_GROUP_CHOICES
from moe_lightning.hrm.costmodel import Estimate, Policy, estimate
from moe_lightning.hrm.hardware import HardwareProfile
from moe_lightning.hrm.layercost import (
    EXPECTED_USE,
    MAX_CONTEXT,
    NO_QUANT,
    CostModel,
    Headroom,
    LayerCost,
    Workload,
    largest_fitting,
)
from moe_lightning.hrm.resident import best_resident
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


class Grid(NamedTuple):
    """Policies less their resident count, one per element, in the order the search tries them."""

    n: np.ndarray
    mu: np.ndarray
    att_gpu: np.ndarray
    exp_gpu: np.ndarray
    r_c: np.ndarray
    groups: npt.ArrayLike = 0  # Policy.expert_groups, per point or one for all

    def cost(self, model: CostModel, resident: npt.ArrayLike, at: slice | np.ndarray = slice(None)) -> LayerCost:
        """The points `at` (a slice or indices) with `resident` pages on the device."""
        groups = self.groups[at] if isinstance(self.groups, np.ndarray) else self.groups
        n, mu, att, exp, r_c = self.n[at], self.mu[at], self.att_gpu[at], self.exp_gpu[at], self.r_c[at]
        return model.layer(n, mu, att, exp, resident, r_c, groups=groups)


def grouped(g: Grid, choice: int, max_group_tokens: int | None = None) -> tuple[Grid, np.ndarray]:
    """The grid with `choice` groups of micro-batches where that groups them (0 elsewhere: 0, or as
    many groups as micro-batches or more, is the per-micro-batch schedule, so the plan says 0), and
    which points may run it: gpu_expert splits a group holding more than `max_group_tokens` tokens
    (the largest micro-batch its activation reserve holds), so such a point would not run as planned."""
    n_ub = g.n // g.mu
    groups = np.where((choice > 0) & (choice < n_ub), choice, 0)
    allowed = np.ones(n_ub.shape, dtype=bool)
    if max_group_tokens is not None:
        largest = -(-n_ub // np.where(groups > 0, groups, n_ub)) * g.mu
        allowed = (largest <= max(max_group_tokens, 1)) | (groups == 0)
    return g._replace(groups=groups.astype(np.int64)), allowed


def make_grid(points: Iterable[tuple[int, int]], places: Iterable[tuple[bool, bool]]) -> Grid:
    """(N, mu) points x placements (attention on the device?, experts on the device?) x the KV cache's
    share on the device (KV_GPU_FRACTIONS with attention there, else 0): point-major."""
    slots = [(a, x, r) for a, x in places for r in (KV_GPU_FRACTIONS if a else (0.0,))]
    pairs = np.array(list(points), dtype=np.int64).reshape(-1, 2)
    att, exp, r_c = (np.tile(np.array([s[i] for s in slots]), len(pairs)) for i in range(3))
    n, mu = np.repeat(pairs[:, 0], len(slots)), np.repeat(pairs[:, 1], len(slots))
    return Grid(n, mu, att.astype(bool), exp.astype(bool), r_c.astype(np.float64))


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


def max_batch(
    spec: ModelSpec,
    work: Workload,
    hw: HardwareProfile,
    dtype: str | None,
    headroom: Headroom,
    cap: int,
    kv_dtype: str | None = None,
    quant: QuantScheme = NO_QUANT,
    kv_rule: str = EXPECTED_USE,
) -> int:
    """The largest N whose KV cache (in `kv_dtype`, counted by `kv_rule`) and weights fit in host memory
    (attention on CPU), at most cap: with a 16-bit cache twice the sequences of an fp32 one."""
    model = CostModel(spec, work, hw, dtype, headroom, kv_dtype, quant, kv_rule)

    def host_bytes(n: int) -> float:
        return model.layer(n, 1, False, True, 0, 0.0).cpu_bytes  # estimate()'s Policy(n, 1)

    one = host_bytes(1)
    room = model.cpu_capacity - one
    if room < 0:
        return 0
    per_seq = host_bytes(2) - one
    linear = int(min(cap, 1 + room // max(per_seq, 1.0)))
    if model.kv_rule == MAX_CONTEXT:  # host bytes are linear in N: one step, the numbers plans had before
        return linear
    # the headroom's sqrt(N) bends the line down, so `linear` is a guess from below: search from there
    return largest_fitting(lambda n: host_bytes(n) <= model.cpu_capacity, cap, linear)


def optimize(
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
    kv_rule: str = EXPECTED_USE,
    expert_groups: Iterable[int] = EXPERT_GROUP_CHOICES,
) -> Estimate:
    """The best fitting policy; raises ValueError when nothing fits (the message says why), or for a
    dtype that is not resolved ('auto').

    `resident`: the running gpu_expert's resident expert count (it sized its residency within its
    own budget); the search then keeps it instead of choosing one.

    `max_micro_batch`: the most sequences one micro-batch may hold (the stack's hand-off slots carry
    that many tokens); the number of micro-batches is unbounded (the hand-off's flow control).

    `kv_dtype`: the host KV cache's format (default: the weights'; int8 too); it decides how many
    sequences fit, with `kv_rule`: "expected" (the default: N sequences that take KV as they grow hold
    N (s + n/2) on average, plus headroom) or "max" (each at s + n, as reserved at admission: the paper's
    rule). Both are layercost.kv_tokens.

    `quant`: the format of the expert pages (default: the model dtype); smaller pages stream faster and
    leave room for more resident experts and a larger batch.

    `expert_groups`: the schedules of a layer's experts to choose among (Policy.expert_groups: 0 once
    per micro-batch, g once per group of them; the default lets 2 groups win where they pay, (0,) or
    (2,) fix one). A point with no more micro-batches than groups is planned as 0 (the same schedule),
    and with `max_micro_batch` a group may hold at most that many tokens (gpu_expert splits a larger one).

    `mus` / `n_ubs` replace the default grids (tests compare against brute force on small ones).
    """
    n_max = max_batch(spec, work, hw, dtype, headroom, batch_cap, kv_dtype, quant, kv_rule)
    if n_max < 1:
        raise ValueError(
            f"the weights alone ({spec.num_parameters() / 1e9:.1f} B parameters) do not fit in "
            f"{headroom.cpu:.0%} of host memory ({hw.cpu_memory / 1e9:.0f} GB)"
        )
    choices = check_expert_groups(expert_groups)
    model = CostModel(spec, work, hw, dtype, headroom, kv_dtype, quant, kv_rule)
    # Policy checks the names (and the count) as the grid points' policies did
    places = [Policy(1, 1, a, x, resident or 0) for a in tuple(attention) for x in tuple(experts)]
    mu_max = n_max if max_micro_batch is None else max(1, min(n_max, max_micro_batch))
    points = [
        (mu * n_ub, mu)
        for mu in (micro_batch_sizes(mu_max) if mus is None else [m for m in mus if m <= mu_max])
        for n_ub in (micro_batch_counts(n_max // mu) if n_ubs is None else [u for u in n_ubs if mu * u <= n_max])
    ]
    base = make_grid(points, [(p.attention is Side.DEVICE, p.experts is Side.DEVICE) for p in places])
    winner: tuple[float, Grid, int, np.ndarray] | None = None  # tokens/s, grid, point, resident counts
    searched: set[bytes] = set()  # a choice that plans every point as an earlier one did: the same search
    for choice in choices:
        g, allowed = grouped(base, choice, max_micro_batch)
        key = np.asarray(g.groups).tobytes() + allowed.tobytes()
        if key in searched:
            continue
        searched.add(key)
        tokens, counts = _costed(model, g, resident)
        tokens = np.where(allowed, tokens, -math.inf)
        chosen = _first_best(tokens, g.n)
        if chosen >= 0 and (winner is None or _faster(float(tokens[chosen]), winner[0])):
            winner = (float(tokens[chosen]), g, chosen, counts)
    if winner is None:
        raise ValueError("no policy fits: the dense weights and one micro-batch exceed device memory")
    _, g, chosen, counts = winner
    side = {True: Side.DEVICE, False: Side.HOST}
    policy = Policy(
        int(g.n[chosen]),
        int(g.mu[chosen]),
        side[bool(g.att_gpu[chosen])],
        side[bool(g.exp_gpu[chosen])],
        int(counts[chosen]),
        float(g.r_c[chosen]),
        int(np.asarray(g.groups)[chosen]),
    )
    return estimate(spec, work, hw, policy, dtype, headroom, kv_dtype, quant, kv_rule=kv_rule)


def check_expert_groups(choices: Iterable[int]) -> tuple[int, ...]:
    """The expert-group choices, once each in their order; ValueError unless whole numbers >= 0."""
    out = tuple(dict.fromkeys(choices))
    if not out or any(isinstance(c, bool) or not isinstance(c, int | np.integer) or c < 0 for c in out):
        raise ValueError(
            f"expert_groups must be whole numbers >= 0 (0: once per micro-batch), at least one; got {out!r}"
        )
    return tuple(int(c) for c in out)


def _faster(tokens: float, best: float) -> bool:
    """Whether a later expert-group choice's best replaces an earlier one's: faster beyond a tie."""
    return tokens > best and not math.isclose(tokens, best, rel_tol=1e-9)


def _costed(model: CostModel, g: Grid, resident: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Per point, tokens/s (-inf where nothing fits) and the resident count: the best one, or `resident`."""
    if resident is None:
        return best_resident(model, g)
    point = g.cost(model, resident)  # one count for every point
    tokens = np.where(point.cpu_bytes <= model.cpu_capacity, point.tokens, -math.inf)
    return tokens, np.full(tokens.shape, resident)


def _first_best(tokens: np.ndarray, batches: np.ndarray) -> int:
    """The point the search keeps (-1 when none fits): _beats over the points in order."""
    best: tuple[float, int] | None = None  # tokens/s and batch of the best so far
    chosen = -1
    fitting = np.flatnonzero(tokens > -math.inf)
    # Most points cannot replace the best so far; left out, they leave the same sequence of bests.
    # Once a point is seen the best is at most a tie (rel 1e-9) below it, and each later change either
    # rises or drops by at most a tie: with P points the best stays above the earlier points' largest
    # throughput times (1 - 1e-9)^(P+1), so a point a tie below that cannot beat it (2x for rounding).
    seen = np.maximum.accumulate(np.concatenate(([-math.inf], tokens[fitting][:-1])))
    fitting = fitting[tokens[fitting] >= seen * (1 - 2e-9 * (len(fitting) + 2))]
    for i, t, n in zip(fitting.tolist(), tokens[fitting].tolist(), batches[fitting].tolist(), strict=True):
        if _beats(t, n, best):
            best, chosen = (t, n), i
    return chosen


def brute_force(
    spec: ModelSpec,
    work: Workload,
    hw: HardwareProfile,
    mus: Iterable[int],
    n_ubs: Iterable[int],
    dtype: str | None = None,
    headroom: Headroom = Headroom(),
    kv_dtype: str | None = None,
    quant: QuantScheme = NO_QUANT,
    kv_rule: str = EXPECTED_USE,
    expert_groups: Iterable[int] = EXPERT_GROUP_CHOICES,
) -> Estimate | None:
    """Every policy on the given grid, every resident count, each expert-group choice: the reference the
    tests compare with."""
    winner = None
    for choice in check_expert_groups(expert_groups):
        best = None
        for mu, n_ub, att, exp in itertools.product(mus, n_ubs, ("cpu", "gpu"), ("gpu", "cpu")):
            groups = choice if 0 < choice < n_ub else 0
            for r_c in KV_GPU_FRACTIONS if att == "gpu" else (0.0,):
                for j in range(spec.total_experts + 1):
                    policy = Policy(mu * n_ub, mu, att, exp, j, r_c, groups)
                    est = estimate(spec, work, hw, policy, dtype, headroom, kv_dtype, quant, kv_rule=kv_rule)
                    if est.fits and _better(est, best):
                        best = est
        if best is not None and (winner is None or _faster(best.tokens_per_second, winner.tokens_per_second)):
            winner = best
    return winner
