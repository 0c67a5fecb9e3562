"""The HRM's prefill budget for mixed steps: what a link-bound pass carries for free, else the cap."""

from __future__ import annotations

from dataclasses import replace

from moe_lightning.hrm.archs import ARCHS
from moe_lightning.hrm.hardware import PRESETS
from moe_lightning.hrm.layercost import Workload
from moe_lightning.hrm.optimizer import optimize
from moe_lightning.hrm.prefill_budget import prefill_budget


def test_a_link_bound_plan_fills_the_pass_up_to_the_busier_sides_time() -> None:
    est = optimize(ARCHS["mixtral-8x7b"], Workload(77, 256), PRESETS["t4"], "bfloat16")
    assert est.binding == "link"
    t = est.resource_seconds
    budget = prefill_budget(est, 1 << 30)
    expected = int(est.policy.batch * (t["link"] / max(t["gpu"], t["cpu"]) - 1))
    assert budget == expected > 0
    assert prefill_budget(est, 512) == min(512, expected)  # never past --max-prefill-tokens


def test_a_plan_the_link_does_not_bind_takes_the_largest_chunk() -> None:
    est = optimize(ARCHS["mixtral-8x7b"], Workload(77, 256), PRESETS["t4"], "bfloat16")
    compute_bound = replace(est, binding="gpu")
    assert prefill_budget(compute_bound, 8192) == 8192
    assert prefill_budget(replace(est, resource_seconds={"gpu": 0.0, "cpu": 0.0, "link": 1.0}), 64) == 64
