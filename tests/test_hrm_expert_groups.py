"""Experts once per group of micro-batches in the HRM (Policy.expert_groups): the device reads each
touched expert once a group, g distinct(N / g) experts a layer, and the pipeline fill is one group's
share; the search picks the count where it pays; `plan` reports it (docs/hrm.md "Experts once per
group")."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from host_profile import HOST, SPEC

from moe_lightning.hrm.archs import ARCHS
from moe_lightning.hrm.costmodel import Estimate, Policy, estimate
from moe_lightning.hrm.hardware import PRESETS
from moe_lightning.hrm.layercost import CostModel, Headroom, Workload, distinct_experts
from moe_lightning.hrm.optimizer import brute_force, optimize
from moe_lightning.hrm.schedule_cost import schedule_throughput

MIXTRAL = ARCHS["mixtral-8x7b"]
WORK = Workload(77, 32, 63)  # MT-Bench prompts, plan's defaults
T4 = PRESETS["t4"]
# the link 8x faster: the device binds, its experts memory-bound when each of 7 micro-batches re-reads them
FAST_LINK_T4 = T4.scaled(h2d_bandwidth=8, d2h_bandwidth=8)
PLAN_POLICY = Policy(4704, 672, resident_experts=10)  # what `plan --arch mixtral-8x7b` picks on the T4


def _verdict(est: Estimate) -> tuple[object, ...]:
    """Everything an estimate says, less the policy that asked."""
    return (
        est.stage_seconds,
        est.resource_seconds,
        est.layer_seconds,
        est.tokens_per_second,
        est.gpu_bytes,
        est.cpu_bytes,
        est.stage_work,
        est.link_bytes,
    )


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize(("spec", "hw"), [(MIXTRAL, T4), (ARCHS["olmoe-1b-7b"], PRESETS["l4"]), (SPEC, HOST)])
def test_a_grid_of_groups_is_the_scalar_policy_to_the_bit(spec: object, hw: object, overlap: bool) -> None:
    """Tokens per group N / g are fractional for most of these (21 / 2 = 10.5): numpy's path and
    Python's must still agree exactly, the shared host/device branch and overlap-off included."""
    model = CostModel(spec, Workload(64, 32), hw, "float32", Headroom())
    n_ub, mu, groups = np.meshgrid([1, 2, 3, 7, 40], [1, 3, 32], [0, 1, 2, 3, 5, 100], indexing="ij")
    n_ub, mu, groups = n_ub.ravel(), mu.ravel(), groups.ravel()
    grid = model.layer(n_ub * mu, mu, False, True, 3, 0.0, overlap, groups)
    for i in range(len(n_ub)):
        one = model.layer(int(n_ub[i] * mu[i]), int(mu[i]), False, True, 3, 0.0, overlap, int(groups[i]))
        got = (grid.layer[i], grid.gpu[i], grid.cpu[i], grid.gpu_bytes[i], grid.stages["gpu_experts"].work[1][i])
        want = (one.layer, one.gpu, one.cpu, one.gpu_bytes, one.stages["gpu_experts"].work[1])
        assert tuple(float(v) for v in got) == want, (n_ub[i], mu[i], groups[i])


def test_grouped_reads_are_g_times_the_experts_a_group_touches() -> None:
    spec = ARCHS["olmoe-1b-7b"]  # 64 experts, top 8: a micro-batch of 3 touches ~21 of them, not all
    model = CostModel(spec, WORK, T4, None, Headroom())
    per_mb, grouped = model.layer(21, 3, False, True, 0, 0.0), model.layer(21, 3, False, True, 0, 0.0, groups=2)
    weights = 3 * spec.hidden_size * spec.intermediate_size * model.b  # one expert, model dtype
    assert per_mb.stages["gpu_experts"].work[1] == pytest.approx(7 * distinct_experts(3, spec) * weights)
    assert grouped.stages["gpu_experts"].work[1] == pytest.approx(2 * distinct_experts(10.5, spec) * weights)
    assert grouped.stages["gpu_experts"].work[1] < 0.7 * per_mb.stages["gpu_experts"].work[1]


def test_experts_on_the_host_are_read_per_pass_as_the_devices_are() -> None:
    """gpu_expert's runner computes the host's experts in the same FFN passes (a micro-batch's, or a
    group's): read once a pass, not once a step, or a CPU-only plan splits its batch for nothing."""
    spec = ARCHS["olmoe-1b-7b"]
    model = CostModel(spec, WORK, T4, None, Headroom())
    weights = 3 * spec.hidden_size * spec.intermediate_size * model.b
    for groups, passes, tokens in ((0, 7, 3), (2, 2, 10.5)):
        host = model.layer(21, 3, False, False, 0, 0.0, groups=groups)  # experts on the host, none resident
        assert host.stages["cpu_experts"].work[1] == pytest.approx(passes * distinct_experts(tokens, spec) * weights)
    whole, split = model.layer(64, 64, False, False, 0, 0.0), model.layer(64, 32, False, False, 0, 0.0)
    assert split.stages["cpu_experts"].work[1] > 1.5 * whole.stages["cpu_experts"].work[1]


def test_on_the_t4_plan_grouping_reads_the_experts_twice_not_seven_times() -> None:
    per_mb = estimate(MIXTRAL, WORK, T4, PLAN_POLICY)
    grouped = estimate(MIXTRAL, WORK, T4, replace(PLAN_POLICY, expert_groups=2))
    assert PLAN_POLICY.num_micro_batches == 7 and grouped.policy.effective_expert_groups == 2
    # Mixtral's 8 experts are all touched by 672 tokens, so the bytes are exactly 2/7 of the reads
    assert grouped.stage_work["gpu_experts"][1] == pytest.approx(per_mb.stage_work["gpu_experts"][1] * 2 / 7)
    assert grouped.stage_seconds["gpu_experts"] < 0.8 * per_mb.stage_seconds["gpu_experts"]
    assert grouped.resource_seconds["gpu"] < per_mb.resource_seconds["gpu"]
    # the link binds on the T4, so the device's saving is hidden and the fill, one group's share of
    # the host's time instead of one micro-batch's, makes the layer slower
    assert per_mb.binding == grouped.binding == "link"
    cpu = per_mb.resource_seconds["cpu"]
    assert grouped.layer_seconds - per_mb.layer_seconds == pytest.approx(cpu / 2 - cpu / 7)
    assert grouped.tokens_per_second < per_mb.tokens_per_second
    # a group's FFN holds 4 micro-batches' expert intermediates (2 h2 k fp32 values a token)
    extra = (4 - 1) * 672 * 2 * MIXTRAL.intermediate_size * MIXTRAL.top_k * 4
    assert grouped.gpu_bytes - per_mb.gpu_bytes == extra


def test_where_the_device_is_memory_bound_on_experts_grouping_is_faster() -> None:
    policy = replace(PLAN_POLICY, resident_experts=8)  # room for the group's activations too
    per_mb = estimate(MIXTRAL, WORK, FAST_LINK_T4, policy)
    grouped = estimate(MIXTRAL, WORK, FAST_LINK_T4, replace(policy, expert_groups=2))
    assert per_mb.binding == "gpu"
    work = per_mb.stage_work["gpu_experts"]
    assert work[1] / T4.gpu_bandwidth > work[0] / T4.gpu_flops  # the expert stage waits on HBM, not on FLOPs
    assert grouped.tokens_per_second > 1.1 * per_mb.tokens_per_second
    assert grouped.fits and per_mb.fits


@pytest.mark.parametrize(("n_ub", "groups"), [(1, 2), (2, 2), (2, 5), (1, 1)])
def test_no_more_micro_batches_than_groups_is_the_per_micro_batch_schedule(n_ub: int, groups: int) -> None:
    policy = Policy(n_ub * 672, 672, resident_experts=10)
    per_mb = estimate(MIXTRAL, WORK, T4, policy)
    grouped = estimate(MIXTRAL, WORK, T4, replace(policy, expert_groups=groups))
    assert grouped.policy.effective_expert_groups == n_ub
    assert _verdict(grouped) == _verdict(per_mb)


def test_the_overlap_off_baseline_does_not_group() -> None:
    per_mb = estimate(MIXTRAL, WORK, T4, PLAN_POLICY, overlap=False)
    grouped = estimate(MIXTRAL, WORK, T4, replace(PLAN_POLICY, expert_groups=2), overlap=False)
    assert _verdict(grouped) == _verdict(per_mb)


def test_policy_refuses_a_negative_count() -> None:
    with pytest.raises(ValueError, match="expert_groups must be a whole number >= 0"):
        Policy(8, 4, expert_groups=-1)
    assert Policy(8, 4).effective_expert_groups == 2 and Policy(8, 1, expert_groups=3).effective_expert_groups == 3
    with pytest.raises(ValueError, match="expert_groups must be whole numbers >= 0"):
        optimize(MIXTRAL, WORK, T4, expert_groups=(0, -2))


def test_the_search_picks_two_groups_where_they_pay_and_none_when_fixed() -> None:
    """A micro-batch held at 672 sequences on a T4 with a fast link: per micro-batch the device re-reads
    every expert 3+ times a layer; two groups read them twice. The exhaustive search agrees."""
    mus, n_ubs = [672], [1, 2, 3, 7]
    auto = optimize(MIXTRAL, WORK, FAST_LINK_T4, mus=mus, n_ubs=n_ubs)
    fixed = optimize(MIXTRAL, WORK, FAST_LINK_T4, mus=mus, n_ubs=n_ubs, expert_groups=(0,))
    assert auto.policy.expert_groups == 2 and auto.policy.num_micro_batches == 3
    assert fixed.policy.expert_groups == 0
    assert auto.tokens_per_second > 1.15 * fixed.tokens_per_second
    assert auto == brute_force(MIXTRAL, WORK, FAST_LINK_T4, mus, n_ubs)
    ref = brute_force(MIXTRAL, WORK, FAST_LINK_T4, mus, n_ubs, expert_groups=(0,))
    assert ref is not None and fixed.tokens_per_second == pytest.approx(ref.tokens_per_second, rel=1e-12)
    # the device binds: resident pages change nothing, and the two searches break that tie differently
    assert replace(fixed.policy, resident_experts=0) == replace(ref.policy, resident_experts=0)
    # gpu_expert splits a group of more tokens than its hand-off slots hold: the search does not plan one
    capped = optimize(MIXTRAL, WORK, FAST_LINK_T4, mus=mus, n_ubs=n_ubs, max_micro_batch=672)
    assert capped.policy.expert_groups == 0 and capped == fixed
    roomy = optimize(MIXTRAL, WORK, FAST_LINK_T4, mus=mus, n_ubs=n_ubs, max_micro_batch=1344)
    assert roomy == auto  # 3 micro-batches in 2 groups: 2 x 672 tokens at most


def test_grouping_that_changes_nothing_never_wins() -> None:
    """At most 2 micro-batches, 2 groups is the per-micro-batch schedule: the plan says 0, even fixed."""
    n_ubs = [1, 2]
    auto = optimize(MIXTRAL, WORK, FAST_LINK_T4, n_ubs=n_ubs)
    only_two = optimize(MIXTRAL, WORK, FAST_LINK_T4, n_ubs=n_ubs, expert_groups=(2,))
    assert auto.policy.expert_groups == only_two.policy.expert_groups == 0
    assert auto == only_two == optimize(MIXTRAL, WORK, FAST_LINK_T4, n_ubs=n_ubs, expert_groups=(0,))


def test_on_the_link_bound_t4_the_plan_keeps_one_pass_per_micro_batch() -> None:
    auto = optimize(MIXTRAL, WORK, T4)
    assert auto.binding == "link" and auto.policy.expert_groups == 0
    forced = optimize(MIXTRAL, WORK, T4, expert_groups=(2,))
    assert forced.policy.expert_groups == 2 and forced.tokens_per_second < auto.tokens_per_second


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "moe_lightning.cli", "plan", "--arch", "mixtral-8x7b", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_plan_names_the_expert_schedule_and_reports_it() -> None:
    auto = _plan("--hardware", "t4")
    assert auto.returncode == 0, auto.stderr
    assert "schedule   experts once per micro-batch (each touched expert read 7 times a layer)" in auto.stdout
    out = json.loads(_plan("--hardware", "t4", "--json").stdout)
    assert out["policy"]["expert_groups"] == 0 and out["policy"]["num_micro_batches"] == 7
    grouped = json.loads(_plan("--hardware", "t4", "--json", "--expert-groups", "2").stdout)
    assert grouped["policy"]["expert_groups"] == 2
    assert grouped["predicted_decode_tokens_per_second"] < out["predicted_decode_tokens_per_second"]
    n_ub = grouped["policy"]["num_micro_batches"]
    text = _plan("--hardware", "t4", "--expert-groups", "2").stdout
    sizes = f"{n_ub // 2}-{n_ub // 2 + 1}" if n_ub % 2 else f"{n_ub // 2}"
    assert f"experts once per group, 2 groups of {sizes} micro-batches" in text
    bad = _plan("--expert-groups", "-1")
    assert bad.returncode == 2 and "--expert-groups: must be auto or a whole number of 0 or more" in bad.stderr


def test_compare_paper_puts_the_job_throughput_beside_the_decode_one() -> None:
    out = json.loads(_plan("--compare-paper", "--json").stdout)
    assert len(out["rows"]) == 8
    for row in out["rows"]:
        paper, ours, gen = row["paper"], row["ours"], row["gen_len"]
        w = Workload(77, gen, 63)
        hw = PRESETS[row["hardware"]]
        want_paper = optimize(MIXTRAL, w, hw, "bfloat16", kv_dtype="bfloat16", kv_rule="max", expert_groups=(0,))
        want_ours = optimize(MIXTRAL, w, hw, "bfloat16", kv_dtype="int8", kv_rule="expected")
        assert paper["with_prefill_tokens_per_second"] == schedule_throughput(MIXTRAL, w, want_paper).alternating
        assert ours["with_prefill_tokens_per_second"] == schedule_throughput(MIXTRAL, w, want_ours).mixed
        assert (paper["expert_groups"], ours["expert_groups"]) == (0, want_ours.policy.expert_groups)
        assert (paper["step_schedule"], ours["step_schedule"]) == ("alternating", "mixed")
        assert (
            row["ratio_with_prefill"]
            == ours["with_prefill_tokens_per_second"] / paper["with_prefill_tokens_per_second"]
        )
        # a prefill pass of its own costs the paper's schedule up to half its decode rate
        assert paper["with_prefill_tokens_per_second"] < paper["predicted_decode_tokens_per_second"]
        assert ours["with_prefill_tokens_per_second"] <= ours["predicted_decode_tokens_per_second"] * (1 + 1e-12)
    t4_256 = next(r for r in out["rows"] if r["hardware"] == "t4" and r["gen_len"] == 256)
    assert t4_256["ratio_with_prefill"] > 5  # mixed steps double what int8 KV by expected use gives (3x)
    text = _plan("--compare-paper").stdout
    assert "job/s" in text and "alternating steps, experts once per micro-batch" in text
    line = next(x for x in text.splitlines() if x.startswith("t4") and x.split()[1] == "256")
    want = f"{t4_256['paper']['with_prefill_tokens_per_second']:7.1f}"
    assert want in line and line.endswith(f"{t4_256['ratio_with_prefill']:5.2f}x")
