"""One comparison of a decode step's timings with the HRM (moe_lightning/hrm/stage_accuracy.py), as the
planner, `bench` and bench/hrm_accuracy.py read it."""

from __future__ import annotations

import pytest
from host_profile import HOST, SPEC
from prometheus_client import REGISTRY

from moe_lightning.hrm import stage_accuracy
from moe_lightning.hrm.costmodel import Policy, estimate
from moe_lightning.hrm.hardware import PRESETS
from moe_lightning.hrm.layercost import Workload
from moe_lightning.step_protocol import StepKind, StepTimings
from orchestrator import metrics
from orchestrator.planner import Planner, PlannerConfig

L = SPEC.num_layers
WORK = Workload(64, 32)
T4 = PRESETS["t4"]


def timings(**ns: int) -> StepTimings:
    return StepTimings(StepKind.DECODE, **ns)


def test_host_computed_experts_count_in_the_device_row() -> None:
    for hw in (HOST, T4):
        est = estimate(SPEC, WORK, hw, Policy(16, 16, experts="cpu"), "float32")
        s = est.stage_seconds
        assert s["cpu_experts"] > 0 and "gpu_experts" not in s  # nothing resident: every expert on the host
        want = s["gpu_dense"] + s["cpu_experts"] + s.get("link_experts_io", 0.0)
        assert stage_accuracy.predicted_per_layer(est)["device"] == pytest.approx(want)
    assert "link_experts_io" in s  # the T4's activations to the host experts and back, inside post-attention


def test_the_copy_is_its_own_row_compared_with_the_exposed_wait() -> None:
    est = estimate(SPEC, WORK, T4, Policy(16, 16, experts="gpu", resident_experts=0), "float32")
    s = est.stage_seconds
    predicted = stage_accuracy.predicted_per_layer(est)
    assert predicted["expert_copy"] == pytest.approx(s["link_weights"]) and s["link_weights"] > 0
    assert predicted["device"] == pytest.approx(s["gpu_dense"] + s["gpu_experts"])  # compute only
    shared = estimate(SPEC, WORK, HOST, Policy(16, 16, experts="gpu", resident_experts=0), "float32")
    assert stage_accuracy.predicted_per_layer(shared)["expert_copy"] == pytest.approx(
        shared.stage_seconds["gpu_expert_copy"]
    )
    # the wait for pages lies inside post_attention: the device row is compute without it
    m = stage_accuracy.measured_per_layer(timings(pre_attention=2 * L, post_attention=10 * L, expert_wait=3 * L), 1, L)
    assert m["device"] == pytest.approx(9e-9) and m["expert_copy"] == pytest.approx(3e-9)


def test_per_layer_is_the_total_over_decode_steps_times_layers_and_the_head_is_amortised() -> None:
    steps = 4
    t = timings(pre_attention=10**9, post_attention=3 * 10**9, head=2 * 10**9, step=8 * 10**9)
    m = stage_accuracy.measured_per_layer(t, steps, L)
    n = steps * L
    assert m["device"] == pytest.approx(4 / n)
    assert m["head"] == pytest.approx(2 / n)  # once a step, spread over its layers as the model does
    assert m["layer"] == pytest.approx(8 / n)
    assert m["expert_copy"] == 0.0
    est = estimate(SPEC, WORK, HOST, Policy(16, 16, experts="cpu"), "float32")
    p = stage_accuracy.predicted_per_layer(est)
    assert p["head"] == pytest.approx(est.stage_seconds["gpu_head"])
    assert p["layer"] == est.layer_seconds


def test_attention_is_the_services_compute_never_the_wait() -> None:
    t = timings(attention_wait=5 * 10**9, attention_busy=2 * 10**9, device_attention=10**9)
    assert stage_accuracy.measured_per_layer(t, 1, L)["attention"] == pytest.approx(3 / L)


def test_planner_does_not_take_hidden_attention_for_fast_attention() -> None:
    """Several micro-batches: the device's work on the others hides attention, so the expert side waits
    1/40 of attention's time. The planner reads attention's compute, as cpu_attention's replies report
    it, and corrects nothing (read from the wait, it scaled the host's roofs up 40x and re-planned)."""
    p = Planner(SPEC, HOST, WORK, "float32", kv_tokens=10**6, config=PlannerConfig(patience=3))
    est = estimate(SPEC, p.workload, p.profile, p.policy, "float32")
    pred = stage_accuracy.predicted_per_layer(est)
    attention_ns = int(pred["attention"] * L * 1e9)
    t = timings(
        pre_attention=int(pred["device"] * L * 1e9) // 10,
        post_attention=int(pred["device"] * L * 1e9) * 9 // 10,
        attention_wait=attention_ns // 40,
        attention_busy=attention_ns,
    )
    for _ in range(10):
        assert p.observe_step(p.policy.batch, p.policy.micro_batch_size, t) is None
    assert p.profile == HOST


def test_compare_gives_every_row_or_none_without_steps() -> None:
    est = estimate(SPEC, WORK, HOST, Policy(16, 16, experts="cpu"), "float32")
    t = timings(pre_attention=10**9, post_attention=10**9, head=10**8, step=3 * 10**9)
    rows = stage_accuracy.compare(est, t, 2, L)
    assert tuple(rows) == stage_accuracy.ROWS
    assert rows["expert_copy"].ratio is None and rows["expert_copy"].error is None  # nothing predicted, none waited
    d = rows["device"]
    assert d.ratio == pytest.approx(d.measured / d.predicted) and d.error == pytest.approx(d.predicted / d.measured - 1)
    assert set(stage_accuracy.as_json(rows)) == set(stage_accuracy.LABELS.values())
    lines = stage_accuracy.table(rows)
    assert len(lines) == 1 + len(rows) and "expert copy (exposed wait)" in lines[4]
    assert stage_accuracy.compare(est, t, 0, L) == {} and stage_accuracy.measured_per_layer(t, 0, L) == {}


def test_planner_does_not_take_an_exposed_copy_for_a_slow_device() -> None:
    p = Planner(SPEC, HOST, WORK, "float32", kv_tokens=10**6, config=PlannerConfig(patience=3))
    est = estimate(SPEC, p.workload, p.profile, p.policy, "float32")
    pred = stage_accuracy.predicted_per_layer(est)
    device_ns = int(pred["device"] * L * 1e9)
    t = timings(
        pre_attention=device_ns // 10,
        post_attention=device_ns - device_ns // 10 + device_ns,  # as long again waiting for pages
        expert_wait=device_ns,
        attention_busy=int(pred["attention"] * L * 1e9),
    )
    for _ in range(10):
        assert p.observe_step(p.policy.batch, p.policy.micro_batch_size, t) is None
    assert p.profile == HOST
    prefill = StepTimings(StepKind.PREFILL, pre_attention=10**12, post_attention=10**12)
    for _ in range(10):  # prefill timings are not a decode step's
        assert p.observe_step(p.policy.batch, p.policy.micro_batch_size, prefill) is None
    assert p.profile == HOST


def test_metrics_take_the_kind_from_the_timings() -> None:
    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = value("moe_lightning_stage_seconds_total", stage="head", kind="prefill")
    decodes = value("moe_lightning_decode_batch_size_count")
    metrics.observe_step(0, 0.5, StepTimings(StepKind.PREFILL, head=2 * 10**8, step=4 * 10**8))  # 0 decodes
    assert value("moe_lightning_stage_seconds_total", stage="head", kind="prefill") == pytest.approx(before + 0.2)
    assert value("moe_lightning_decode_batch_size_count") == decodes  # a prefill is no decode batch
    metrics.observe_step(3, 0.5, timings(step=4 * 10**8))
    assert value("moe_lightning_decode_batch_size_count") == decodes + 1
    mixed = value("moe_lightning_stage_seconds_total", stage="head", kind="mixed")
    metrics.observe_step(2, 0.5, StepTimings(StepKind.MIXED, head=10**8, step=4 * 10**8))  # decodes and a prompt
    assert value("moe_lightning_decode_batch_size_count") == decodes + 2
    assert value("moe_lightning_stage_seconds_total", stage="head", kind="mixed") == pytest.approx(mixed + 0.1)
