"""The host's issue time in the HRM (hrm/host_issue.py): measured at calibration, carried by profiles and
the services' measurements, and bounding the device's time per layer in the cost model, so that the
search stops preferring many small micro-batches when the host cannot issue them."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from host_profile import HOST, SPEC
from hrm_reference import SMALL, TOY, exhaustive

from moe_lightning.hrm.archs import ARCHS
from moe_lightning.hrm.costmodel import Policy, estimate
from moe_lightning.hrm.explain import explain, plan_to_dict
from moe_lightning.hrm.hardware import HOST_ISSUE_FIELDS, PRESETS, HardwareProfile
from moe_lightning.hrm.host_issue import host_issue_seconds
from moe_lightning.hrm.layercost import CostModel, Headroom, Workload, distinct_experts
from moe_lightning.hrm.optimizer import best_resident, make_grid, optimize
from moe_lightning.hrm.roofs import Measurements, profile_from
from moe_lightning.hrm.sizes import NO_QUANT

MIXTRAL = ARCHS["mixtral-8x7b"]
WORK = Workload(77, 32)


def with_issue(hw: HardwareProfile, scale: float) -> HardwareProfile:
    """`hw` with the h100 preset's issue terms times `scale` (0: none)."""
    preset = PRESETS["h100"]
    return replace(hw, **{f: getattr(preset, f) * scale for f in HOST_ISSUE_FIELDS})


def test_presets_carry_the_counted_issue_time() -> None:
    for hw in PRESETS.values():
        # ~1 ms for a Mixtral micro-batch that touches its 8 experts: ~200 PyTorch calls at ~5 us
        assert 0.8e-3 < hw.host_issue_seconds(8) < 1.3e-3, hw.name
        assert hw.with_gpus(4).host_micro_batch_seconds == hw.host_micro_batch_seconds  # each rank issues its own


def test_the_search_picks_fewer_micro_batches_when_the_host_cannot_issue_them() -> None:
    """The same machine and workload, the host's issue time zero or large: where launches are free the
    plan splits its batch finely (its pipeline fill shrinks with every micro-batch); where each
    micro-batch costs the host time, it takes fewer, larger ones. (Expert groups fixed at none: with
    them allowed, the search may instead group a model's many experts into fewer FFN passes.)"""
    for arch, hw in (("mixtral-8x7b", "h100"), ("olmoe-1b-7b", "h100"), ("qwen3-30b-a3b", "t4")):
        spec, base = ARCHS[arch], PRESETS[hw]
        options = {"attention": ("cpu",), "experts": ("gpu",), "expert_groups": (0,)}
        free = optimize(spec, WORK, with_issue(base, 0.0), **options)
        costly = optimize(spec, WORK, with_issue(base, 3.0), **options)
        assert free.issue_seconds == 0 and costly.issue_seconds > 0
        assert costly.policy.num_micro_batches < free.policy.num_micro_batches, (arch, free.policy, costly.policy)
        assert costly.tokens_per_second < free.tokens_per_second


POLICIES = [
    Policy(n_ub * mu, mu, att, exp, resident, 0.5 if att == "gpu" else 0.0, groups)
    for n_ub, mu in ((1, 1024), (4, 64), (32, 32), (64, 1), (200, 3))
    for att, exp in (("cpu", "gpu"), ("gpu", "gpu"), ("cpu", "cpu"))
    for resident in (0, 100)
    for groups in (0, 2)
]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("scale", [0.3, 1.0, 10.0])
def test_a_layer_never_takes_less_than_its_micro_batches_take_to_issue(scale: float, overlap: bool) -> None:
    hw = with_issue(PRESETS["h100"], scale)
    for policy in POLICIES:
        est = estimate(MIXTRAL, WORK, hw, policy, overlap=overlap)
        n_ub = policy.num_micro_batches
        assert est.layer_seconds >= n_ub * hw.host_micro_batch_seconds
        if policy.effective_expert_groups == n_ub:  # each micro-batch its own FFN pass over mu tokens' experts
            per_mb = hw.host_issue_seconds(distinct_experts(policy.micro_batch_size, MIXTRAL))
            assert est.issue_seconds == pytest.approx(n_ub * per_mb, rel=1e-12)
            assert est.layer_seconds >= n_ub * per_mb * (1 - 1e-12)
        # a GPU: the device's time is the larger of its compute and the host's issue, not their sum
        assert est.resource_seconds["gpu"] == max(est.gpu_compute_seconds, est.issue_seconds)


def test_expert_groups_issue_one_ffn_pass_a_group() -> None:
    hw = with_issue(PRESETS["h100"], 1.0)
    per_mb = estimate(MIXTRAL, WORK, hw, Policy(1024, 32))
    grouped = estimate(MIXTRAL, WORK, hw, Policy(1024, 32, expert_groups=2))
    passes = 2 * (hw.host_ffn_seconds + distinct_experts(512, MIXTRAL) * hw.host_expert_seconds)
    assert grouped.issue_seconds == pytest.approx(32 * hw.host_micro_batch_seconds + passes, rel=1e-12)
    assert grouped.issue_seconds < 0.5 * per_mb.issue_seconds


def test_on_a_cpu_device_the_issue_time_adds_to_compute() -> None:
    hw = replace(HOST, host_micro_batch_seconds=1e-4, host_ffn_seconds=3e-5, host_expert_seconds=3e-5)
    for policy in (Policy(64, 8), Policy(64, 64), Policy(64, 8, experts="cpu", expert_groups=2)):
        est = estimate(SPEC, Workload(64, 32), hw, policy, "float32")
        none = estimate(SPEC, Workload(64, 32), HOST, policy, "float32")
        assert est.issue_seconds > 0 and none.issue_seconds == 0
        assert est.resource_seconds["gpu"] == est.gpu_compute_seconds + est.issue_seconds
        assert est.gpu_compute_seconds == none.resource_seconds["gpu"]
        assert est.layer_seconds == pytest.approx(none.layer_seconds + est.issue_seconds, rel=1e-12)


def test_no_issue_time_leaves_every_estimate_as_it_was() -> None:
    for policy in POLICIES:
        est = estimate(MIXTRAL, WORK, with_issue(PRESETS["h100"], 0.0), policy)
        assert est.issue_seconds == 0 and "gpu_issue" not in est.stage_seconds
        assert est.resource_seconds["gpu"] == est.gpu_compute_seconds


@pytest.mark.parametrize("shared", [False, True])
def test_the_search_with_an_issue_time_is_the_exhaustive_one(shared: bool) -> None:
    """The array search and the one-policy-at-a-time one (tests/hrm_reference.py) agree where the
    issue time is of the order of the layer's other times (TOY's layers take ~0.1-2 ms)."""
    hw = replace(TOY, shared_host_device=shared, host_micro_batch_seconds=4e-6, host_ffn_seconds=2e-6)
    hw = replace(hw, host_expert_seconds=1e-6)
    for options in ({}, {"experts": ("cpu",)}, {"attention": ("gpu",), "experts": ("cpu",)}):
        args = (SMALL, Workload(24, 16), hw, "float32")
        assert optimize(*args, batch_cap=128, **options) == exhaustive(*args, batch_cap=128, **options), options


def test_the_resident_count_tries_the_corner_where_compute_passes_the_issue() -> None:
    """Experts on the host: the device's time is max(compute, issue), flat in the resident count until
    compute passes the issue, while the pipeline fill keeps shrinking with the host's time. Here the
    best count sits at that corner for one grid point; without trying it (only where the device's line
    meets the host's) the closed form settled 0.5 % short. At every point it is the full scan's best."""
    spec, work = ARCHS["qwen1.5-moe-a2.7b"], Workload(77, 32)
    model = CostModel(spec, work, with_issue(PRESETS["a100-40g"], 0.1), None, Headroom())
    g = make_grid(
        [(n_ub * mu, mu) for mu in (1, 3, 32, 256) for n_ub in (1, 2, 7, 40)], [(False, False), (True, False)]
    )
    tokens, _ = best_resident(model, g)
    counts = np.arange(spec.total_experts + 1)
    for i in np.flatnonzero(tokens > -math.inf):
        every = g.cost(model, counts, np.full(counts.shape, i))
        fits = (every.gpu_bytes <= model.gpu_capacity) & (every.cpu_bytes <= model.cpu_capacity)
        assert tokens[i] >= every.tokens[fits].max() * (1 - 1e-12), i


def test_calibration_measures_a_positive_issue_time_on_the_cpu_in_bounded_time() -> None:
    t0 = time.monotonic()
    issue = host_issue_seconds("cpu", torch.float32)
    assert time.monotonic() - t0 < 5.0
    assert all(math.isfinite(v) and v >= 0 for v in issue)
    assert issue.micro_batch > 0 and issue.per_micro_batch(8) > issue.micro_batch
    assert issue.per_micro_batch(8) < 0.05  # ~0.2-2 ms of calls, not a measurement of something else


def test_a_profile_written_before_the_issue_time_loads_without_it(tmp_path: Path) -> None:
    old = {k: v for k, v in asdict(PRESETS["h100"]).items() if k not in HOST_ISSUE_FIELDS}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    hw = HardwareProfile.from_file(path)
    assert all(getattr(hw, f) == 0.0 for f in HOST_ISSUE_FIELDS) and hw.gpu_flops == PRESETS["h100"].gpu_flops
    assert estimate(MIXTRAL, WORK, hw, Policy(1024, 32)).issue_seconds == 0
    # the services' measurements too: an older gpu_expert's (or cache's) carry none
    fields = asdict(Measurements(1e12, 1e11, memory_bytes=1e10, h2d_bandwidth=1e10, d2h_bandwidth=1e10))
    m = Measurements(**{k: v for k, v in fields.items() if k not in HOST_ISSUE_FIELDS})
    assert profile_from(m, Measurements(1e11, attention_bandwidth=1e10, memory_bytes=1e11)).host_ffn_seconds == 0


def test_measured_issue_times_travel_from_gpu_expert_to_the_plan() -> None:
    from moe_lightning.service.convert import measurements_from_pb, measurements_to_pb

    expert = Measurements(1e12, 1e11, memory_bytes=1e10, h2d_bandwidth=1e10, d2h_bandwidth=1e10)
    expert = replace(expert, host_micro_batch_seconds=3e-4, host_ffn_seconds=1e-4, host_expert_seconds=7e-5)
    again = measurements_from_pb(measurements_to_pb(expert))
    assert again == expert
    hw = profile_from(again, Measurements(1e11, attention_bandwidth=1e10, memory_bytes=1e11))
    assert (hw.host_micro_batch_seconds, hw.host_ffn_seconds, hw.host_expert_seconds) == (3e-4, 1e-4, 7e-5)


@pytest.mark.parametrize("field", HOST_ISSUE_FIELDS)
@pytest.mark.parametrize("value", [-1e-6, math.inf, math.nan])
def test_an_issue_time_must_be_finite_and_not_negative(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        replace(PRESETS["h100"], **{field: value})


def test_the_plan_says_when_the_host_issue_binds() -> None:
    hw = with_issue(PRESETS["h100"], 1.0)
    est = estimate(ARCHS["olmoe-1b-7b"], WORK, hw, Policy(1024, 32))
    assert est.binding == "gpu" and est.issue_seconds > est.gpu_compute_seconds
    text = explain("olmoe", ARCHS["olmoe-1b-7b"], WORK, hw, est)
    assert "host issue" in text and "host's kernel issue" in text
    out = plan_to_dict("olmoe", ARCHS["olmoe-1b-7b"], WORK, hw, est)
    assert out["host_issue_seconds_per_layer"] == est.issue_seconds


def test_the_drift_checks_device_row_holds_the_issue_time() -> None:
    """The planner compares gpu_expert's device spans with this row: they last as long as the host
    takes to issue them on a GPU, and include the calls' fixed cost on a CPU device."""
    from moe_lightning.hrm.stage_accuracy import predicted_per_layer

    gpu = estimate(ARCHS["olmoe-1b-7b"], WORK, with_issue(PRESETS["h100"], 1.0), Policy(1024, 32))
    assert predicted_per_layer(gpu)["device"] == gpu.issue_seconds > gpu.gpu_compute_seconds
    hw = replace(HOST, host_micro_batch_seconds=1e-4, host_ffn_seconds=3e-5, host_expert_seconds=3e-5)
    cpu, none = (estimate(SPEC, Workload(64, 32), h, Policy(64, 8), "float32") for h in (hw, HOST))
    assert predicted_per_layer(cpu)["device"] == pytest.approx(predicted_per_layer(none)["device"] + cpu.issue_seconds)


def test_the_issue_time_is_measured_once_for_every_model(tmp_path: Path) -> None:
    """It is measured on a tiny layer whatever the model: two models' calibrations share one measurement
    (a suite of a hundred model shapes once paid ~1 s for each); --recalibrate measures it again."""
    from moe_lightning.hrm import calibrate

    cpu = torch.device("cpu")
    first = calibrate.cached_host_issue(cpu, torch.float32, NO_QUANT, cache_dir=tmp_path)
    [path] = tmp_path.glob("*-host_issue-cpu-float32-none-*.json")
    path.write_text(json.dumps({"micro_batch": 1.0, "ffn": 2.0, "expert": 3.0}))  # read back, not measured
    assert calibrate.cached_host_issue(cpu, torch.float32, NO_QUANT, cache_dir=tmp_path).expert == 3.0
    again = calibrate.cached_host_issue(cpu, torch.float32, NO_QUANT, refresh=True, cache_dir=tmp_path)
    assert again.expert < 1.0 and first.expert < 1.0  # measured: microseconds, not the planted seconds
