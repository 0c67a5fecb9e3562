"""The HRM inside the orchestrator: start-up plan, drift detection, profile correction, re-plans."""

from __future__ import annotations

import pytest
from host_profile import HOST, SPEC

from moe_lightning.hrm.costmodel import Policy, estimate
from moe_lightning.hrm.layercost import Workload
from moe_lightning.step_protocol import StepKind, StepTimings
from orchestrator.planner import Planner, PlannerConfig


def timings_for(planner: Planner, batch: int, device_factor: float, attention_factor: float) -> StepTimings:
    """Step timings as gpu_expert reports them on a machine `factor` times slower than HOST says."""
    s = estimate(SPEC, planner.workload, HOST, Policy(batch, batch), "float32").stage_seconds
    layers = SPEC.num_layers
    device = (s["gpu_dense"] + s["gpu_experts"]) * device_factor * layers
    return StepTimings(
        StepKind.DECODE,
        pre_attention=int(0.1 * device * 1e9),
        post_attention=int(0.9 * device * 1e9),
        attention_wait=int(s["cpu_attention"] * attention_factor * layers * 1e9),
    )


def test_plan_fits_the_kv_cache_and_stays_when_predictions_hold() -> None:
    p = Planner(SPEC, HOST, Workload(64, 32), "float32", kv_tokens=16 * 96, config=PlannerConfig(patience=5))
    assert p.policy.batch <= 16 and p.policy.attention == "cpu"  # 1536 KV tokens / 96 per request
    for _ in range(50):
        assert p.observe_step(16, 16, timings_for(p, 16, 1.1, 0.9)) is None  # within 25 %


def test_slow_device_is_corrected_and_replanned() -> None:
    p = Planner(SPEC, HOST, Workload(64, 32), "float32", kv_tokens=10**6, config=PlannerConfig(patience=5))
    before = p.estimate.tokens_per_second
    gpu_bw = p.profile.gpu_bandwidth
    results = [p.observe_step(16, 16, timings_for(p, 16, 2.0, 1.0)) for _ in range(12)]
    assert any(r is not None for r in results) or p.estimate.tokens_per_second < before
    assert p.profile.gpu_bandwidth == pytest.approx(gpu_bw / 2, rel=0.15)  # the roof now matches what ran
    assert p.profile.cpu_bandwidth == HOST.cpu_bandwidth  # the accurate side was left alone
    assert "corrected online" in p.profile.source
    assert p.estimate.tokens_per_second < before


def test_workload_drift_replans() -> None:
    p = Planner(SPEC, HOST, Workload(64, 32), "float32", kv_tokens=200_000)
    first = p.policy
    changed = None
    for _ in range(20):
        changed = p.observe_request(1000, 500) or changed
    assert p.workload.prompt_len > 500 and p.workload.gen_len > 250
    assert changed is not None and changed.batch < first.batch  # longer contexts: fewer fit in the cache
