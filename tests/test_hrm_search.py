"""The policy search costs whole grids at once with the formula estimate() runs for one policy: element
by element its numbers are estimate()'s to the bit, its resident counts are the exhaustive search's,
and so are its plans."""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from host_profile import HOST, SPEC
from hrm_reference import best_resident as reference_best_resident
from hrm_reference import exhaustive

from moe_lightning.demo_model import mixtral_config
from moe_lightning.hrm.archs import ARCHS
from moe_lightning.hrm.costmodel import Estimate, Policy, estimate
from moe_lightning.hrm.hardware import PRESETS, HardwareProfile, with_simulated_link
from moe_lightning.hrm.layercost import CostModel, Headroom, Workload
from moe_lightning.hrm.optimizer import best_resident, make_grid, optimize
from moe_lightning.quant.scheme import QuantFormat, QuantScheme
from moe_lightning.spec import ModelSpec

SMALL = ModelSpec.from_hf_config(mixtral_config("tiny"))
TOY = HardwareProfile("toy", 2e9, 4e9, 3.0e6, 4e8, 1e9, 40e6, 2e8, 2e8, compute_capability=8.0)
INT8, INT4 = QuantScheme(QuantFormat.INT8), QuantScheme(QuantFormat.INT4, 128)
QUANTS = (QuantScheme(), INT8, INT4, QuantScheme(QuantFormat.INT4, 32))
HALF_DENSE = replace(  # Qwen-MoE style: every other layer one dense MLP
    ARCHS["qwen3-30b-a3b"], dense_layers=tuple(range(0, 48, 2)), dense_intermediate_size=6144
)
OPTIONS: tuple[dict[str, Any], ...] = (
    {},
    {"kv_dtype": "float32"},
    {"attention": ("gpu",)},
    {"attention": ("cpu",), "experts": ("cpu",)},
    {"resident": 40},
    {"max_micro_batch": 64},
    {"attention": ("gpu",), "experts": ("cpu",), "kv_dtype": "bfloat16"},
    {"dtype": "float16", "headroom": Headroom(0.7, 0.9)},
)
WORKLOADS = (Workload(77, 32), Workload(77, 256), Workload(512, 128))


def _cases() -> list[tuple[ModelSpec, Workload, HardwareProfile, dict[str, Any]]]:
    """Every arch, preset, page format and option, rotated against each other; host memory as the
    paper's (416 GB) or the preset's; batches capped where the exhaustive search would take seconds."""
    out = []
    for i, (arch, preset) in enumerate(itertools.islice(itertools.cycle(itertools.product(ARCHS, PRESETS)), 30)):
        hw = PRESETS[preset].with_gpus((1, 2, 4)[i % 3])
        hw = hw.scaled(cpu_memory=416e9 / hw.cpu_memory) if i % 4 else hw
        options = {**OPTIONS[i % len(OPTIONS)], "quant": QUANTS[i % len(QUANTS)], "batch_cap": (384, 768)[i % 2]}
        out.append((ARCHS[arch], WORKLOADS[i % len(WORKLOADS)], hw, options))
    shared = replace(PRESETS["l4"], shared_host_device=True, cpu_memory=416e9)
    measured = replace(PRESETS["l4"], expert_format=INT4.key(), expert_flops=3e13, expert_bandwidth=2e11)
    out += [
        (HALF_DENSE, Workload(77, 64), PRESETS["t4"].with_gpus(4).scaled(cpu_memory=2.2), {"batch_cap": 1024}),
        (ARCHS["mixtral-8x7b"], Workload(77, 32), shared, {"batch_cap": 512, "quant": INT8}),
        (ARCHS["mixtral-8x7b"], Workload(77, 32), measured, {"quant": INT4, "experts": ("gpu",), "batch_cap": 1024}),
        (SPEC, Workload(64, 32), HOST, {"dtype": "float32", "batch_cap": 256}),
        (SPEC, Workload(64, 32), HOST, {"dtype": "float32", "quant": INT8, "resident": 3, "batch_cap": 256}),
        (SMALL, Workload(24, 16), TOY, {"dtype": "float32"}),
        (SMALL, Workload(24, 16), TOY.scaled(gpu_memory=0.5), {"dtype": "float32", "quant": QUANTS[3]}),
        (SMALL, Workload(24, 16), TOY.scaled(h2d_bandwidth=20), {"dtype": "float32", "max_micro_batch": 3}),
        # a CPU device behind a simulated link (gpu_expert --link-bandwidth): link-bound and not
        (SPEC, Workload(64, 32), with_simulated_link(HOST, 2e8), {"dtype": "float32", "batch_cap": 256}),
        (SPEC, Workload(64, 32), with_simulated_link(HOST, 2e9), {"dtype": "float32", "experts": ("gpu",)}),
    ]
    return out


CASES = _cases()


def _plan(search: Any, spec: ModelSpec, work: Workload, hw: HardwareProfile, options: dict[str, Any]) -> Any:
    try:
        return search(spec, work, hw, **options)
    except ValueError as exc:  # nothing fits: the same reason
        return str(exc)


@functools.cache
def _fast(case: int) -> Any:
    return _plan(optimize, *CASES[case])


@pytest.mark.parametrize("case", range(len(CASES)))
def test_optimize_returns_what_the_exhaustive_search_returned(case: int) -> None:
    assert _fast(case) == _plan(exhaustive, *CASES[case])  # the whole Estimate: policy, tokens/s, times, memories


def test_the_cases_plan_every_placement() -> None:
    plans = [_fast(case) for case in range(len(CASES))]
    placements = {(p.policy.attention, p.policy.experts) for p in plans if isinstance(p, Estimate)}
    assert sum(isinstance(p, Estimate) for p in plans) >= 30 and len(placements) == 4


CONTEXTS = [  # (spec, work, hw, dtype, kv_dtype, quant): where the cost model branches
    (ARCHS["mixtral-8x7b"], Workload(77, 32), PRESETS["t4"], None, None, QuantScheme()),
    (ARCHS["dbrx"], Workload(512, 128), PRESETS["l4"].with_gpus(2), None, "float32", INT4),
    (ARCHS["olmoe-1b-7b"], Workload(77, 256), PRESETS["h100"], "float16", None, INT8),
    (HALF_DENSE, Workload(77, 64), PRESETS["a100-40g"], None, "bfloat16", QuantScheme(QuantFormat.INT4, 32)),
    (ARCHS["qwen1.5-moe-a2.7b"], Workload(77, 32), replace(PRESETS["l4"], shared_host_device=True), None, None, INT4),
    (SPEC, Workload(64, 32), replace(HOST, expert_format="int8", expert_bandwidth=1e9), "float32", None, INT8),
    (SPEC, Workload(64, 32), with_simulated_link(HOST, 3e8), "float32", None, QuantScheme()),
    (SPEC, Workload(64, 32), with_simulated_link(HOST, 3e8), "float32", None, INT8),
]
POINTS = [(n_ub * mu, mu) for mu in (1, 3, 32, 256) for n_ub in (1, 2, 7, 40)]
GROUPS = np.array([0, 2, 3, 5, 40, 1], dtype=np.int64)  # Policy.expert_groups: 7 x mu in 2 or 3 is fractional
PLACES = [(a, e, r_c) for a in (False, True) for e in (False, True) for r_c in ((0.0, 0.5, 1.0) if a else (0.0,))]


def _side(on_device: bool) -> str:
    return "gpu" if on_device else "cpu"


@pytest.mark.parametrize("context", CONTEXTS, ids=[str(i) for i in range(len(CONTEXTS))])
def test_grid_cost_is_estimate_to_the_bit(context: tuple[Any, ...]) -> None:
    """The search evaluates the formula on arrays, estimate() on one policy: numpy must not round any
    element differently (a value one ulp off could tip a tie and change the plan)."""
    spec, work, hw, dtype, kv_dtype, quant = context
    model = CostModel(spec, work, hw, dtype, Headroom(), kv_dtype, quant)
    g = make_grid(POINTS, [(a, e) for a, e, r_c in PLACES if r_c == 0.0])
    g = g._replace(groups=np.resize(GROUPS, len(g.n)))  # every count of groups against every point, in turn
    total = spec.total_experts
    for j in sorted({0, 1, total // 3, total - 1, total}):
        cost = g.cost(model, j)
        for i in range(len(g.n)):
            n, mu, att, exp, r_c = int(g.n[i]), int(g.mu[i]), bool(g.att_gpu[i]), bool(g.exp_gpu[i]), float(g.r_c[i])
            policy = Policy(n, mu, _side(att), _side(exp), j, r_c, int(g.groups[i]))
            est = estimate(spec, work, hw, policy, dtype, Headroom(), kv_dtype, quant)
            want = (
                est.tokens_per_second,
                est.layer_seconds,
                *est.resource_seconds.values(),
                est.gpu_bytes,
                est.cpu_bytes,
            )
            got = (cost.tokens, cost.layer, cost.gpu, cost.cpu, cost.link, cost.gpu_bytes, cost.cpu_bytes)
            assert tuple(float(v[i]) for v in got) == want, (n, mu, att, exp, j, r_c, policy.expert_groups)
    assert (model.gpu_capacity, model.cpu_capacity) == (est.gpu_capacity, est.cpu_capacity)


@pytest.mark.parametrize("context", CONTEXTS, ids=[str(i) for i in range(len(CONTEXTS))])
def test_best_resident_is_the_reference_count(context: tuple[Any, ...]) -> None:
    """Per grid point, the array search's resident count and throughput are the ones the one-policy-at-
    a-time search (tests/hrm_reference.py) finds, or none where it finds none."""
    spec, work, hw, dtype, kv_dtype, quant = context
    for scale in (1.0, 0.3, 4.0):  # device memory binding on the resident count, or not
        box = hw.scaled(gpu_memory=scale)
        g = make_grid(POINTS, [(a, e) for a, e, r_c in PLACES if r_c == 0.0])
        g = g._replace(groups=np.resize(GROUPS, len(g.n)))
        tokens, counts = best_resident(CostModel(spec, work, box, dtype, Headroom(), kv_dtype, quant), g)
        for i in range(len(g.n)):
            n, mu, att, exp, r_c = int(g.n[i]), int(g.mu[i]), bool(g.att_gpu[i]), bool(g.exp_gpu[i]), float(g.r_c[i])
            base = Policy(n, mu, _side(att), _side(exp), 0, r_c, int(g.groups[i]))
            ref = reference_best_resident(spec, work, box, base, dtype, Headroom(), kv_dtype, quant)
            got = (float(tokens[i]), int(counts[i])) if tokens[i] > float("-inf") else None
            assert got == (None if ref is None else (ref.tokens_per_second, ref.policy.resident_experts)), (i, scale)
