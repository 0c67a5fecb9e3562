"""The HRM's throughput of a long job, prefill included, in both step schedules (hrm/schedule_cost.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from moe_lightning.hrm.archs import ARCHS
from moe_lightning.hrm.hardware import PRESETS
from moe_lightning.hrm.layercost import Workload
from moe_lightning.hrm.optimizer import optimize
from moe_lightning.hrm.schedule_cost import schedule_throughput

MIXTRAL = ARCHS["mixtral-8x7b"]


@pytest.mark.parametrize("gen", [32, 64, 128, 256])
def test_on_a_link_bound_t4_mixed_steps_beat_a_prefill_pass_of_their_own(gen: int) -> None:
    work = Workload(77, gen)
    est = optimize(MIXTRAL, work, PRESETS["t4"], "bfloat16")
    st = schedule_throughput(MIXTRAL, work, est)
    assert est.binding == "link"
    assert st.alternating < st.mixed <= st.decode_only  # prefill costs something, never a whole pass mixed
    # short generations bring so many prompt tokens a step (P = N s / n) that their compute binds either
    # way; from gen 128 on, the prefill pass alternating pays is what mixed steps save
    assert st.mixed_vs_alternating >= (1.3 if gen >= 128 else 1.0)
    assert st.prompt_tokens_per_step == pytest.approx(est.policy.batch * 77 / gen)


def test_where_the_device_binds_the_prompt_tokens_cost_their_compute() -> None:
    work = Workload(77, 64)
    est = optimize(MIXTRAL, work, PRESETS["t4"], "bfloat16")
    t = est.resource_seconds
    busy = replace(est, resource_seconds={**t, "gpu": 2 * t["link"]}, layer_seconds=2 * t["link"])
    st = schedule_throughput(MIXTRAL, work, busy)
    n, p = est.policy.batch, st.prompt_tokens_per_step
    layers = MIXTRAL.num_layers
    assert st.mixed == pytest.approx(n / (layers * 2 * t["link"] * (n + p) / n))  # every token costs device time
    assert st.alternating <= st.mixed * (1 + 1e-12)  # the same compute either way when it binds


def test_plan_prints_and_reports_both_schedules() -> None:
    run = [sys.executable, "-m", "moe_lightning.cli", "plan", "--arch", "mixtral-8x7b", "--hardware", "t4"]
    text = subprocess.run([*run, "--gen-len", "256"], capture_output=True, text=True, check=True).stdout
    assert "with prefill" in text and "mixed steps" in text and "alternating" in text
    out = json.loads(subprocess.run([*run, "--json"], capture_output=True, text=True, check=True).stdout)
    both = out["with_prefill_tokens_per_second"]
    assert both["mixed"] > both["alternating"] > 0 and out["prompt_tokens_per_step"] > 0
