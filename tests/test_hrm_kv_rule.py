"""The HRM's KV rule: N sized by the expected KV of a generation (s + n/2 plus headroom) or, the paper's
rule, by every sequence at its maximum context; in any KV format, int8 included."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from host_profile import HOST, SPEC
from hrm_reference import SMALL, TOY

from moe_lightning.commands.plan import KV_RULE_CHOICES
from moe_lightning.hrm.archs import ARCHS
from moe_lightning.hrm.costmodel import Policy, estimate
from moe_lightning.hrm.hardware import PRESETS
from moe_lightning.hrm.layercost import (
    ARRAYS,
    KV_RULE_FOR_ADMISSION,
    KV_RULES,
    Headroom,
    Workload,
    kv_sequences,
    kv_token_bytes,
    kv_tokens,
)
from moe_lightning.hrm.optimizer import brute_force, max_batch, optimize
from moe_lightning.kv_format import bytes_per_token
from orchestrator.planner import Planner, PlannerConfig

MIXTRAL, T4, L4 = ARCHS["mixtral-8x7b"], PRESETS["t4"], PRESETS["l4"]
NO_HEADROOM = Headroom(kv_sigmas=0.0)
BIG = 10**9  # a batch cap that never binds


def test_fixed_lengths_without_headroom_hold_max_over_mean_times_the_sequences() -> None:
    """Every prompt s tokens, no headroom: a cache holds T / (s + n/2) sequences by expected use, T / (s + n)
    reserved at the maximum; the host memory's batch grows by nearly that ratio (hand-off staging is per
    sequence too)."""
    for gen in (32, 64, 128, 256):
        work = Workload(77, gen)
        tokens = 10**6
        assert kv_sequences(tokens, work, "max") == tokens // (77 + gen)
        assert kv_sequences(tokens, work, "expected", NO_HEADROOM) == math.floor(tokens / (77 + gen / 2))
        n_max = max_batch(MIXTRAL, work, T4, None, NO_HEADROOM, BIG, kv_rule="max")
        n_exp = max_batch(MIXTRAL, work, T4, None, NO_HEADROOM, BIG, kv_rule="expected")
        expected_ratio = (77 + gen) / (77 + gen / 2)
        assert n_exp / n_max == pytest.approx(expected_ratio, rel=0.01)
        assert n_exp / n_max <= expected_ratio  # the staging only takes away


def test_expected_use_gains_more_the_longer_the_generation() -> None:
    work = Workload(77, 32, 63)
    batches, gains = [], []
    for gen in (16, 32, 64, 128, 256, 512):
        w = replace(work, gen_len=gen)
        n_exp = max_batch(MIXTRAL, w, T4, None, Headroom(), BIG, kv_rule="expected")
        batches.append(n_exp)
        gains.append(n_exp / max_batch(MIXTRAL, w, T4, None, Headroom(), BIG, kv_rule="max"))
    assert batches == sorted(batches, reverse=True)  # longer generations: fewer sequences
    assert gains == sorted(gains) and gains[0] > 1.0  # ... but relatively more than the paper's rule


def test_sliding_layers_hold_and_read_only_their_window_by_expected_use() -> None:
    """GPT-OSS-120B at 2,048-token prompts: half its layers keep (and read) 128 tokens, so by need the
    host holds ~1 / attended_share its sequences with every layer full, and a sequence's decode attention
    costs that share; reserved at the maximum (the paper's rule) it holds every layer's context."""
    oss = ARCHS["gpt-oss-120b"]
    full = replace(oss, sliding_window=None, sliding_layers=None)
    work = Workload(2048, 32)
    share = oss.attended_share(work.avg_context)
    assert share == pytest.approx((1 + 128 / work.avg_context) / 2)
    hw = replace(T4, cpu_memory=512e9)  # bf16 weights: 234 GB
    windowed = max_batch(oss, work, hw, None, NO_HEADROOM, BIG, kv_rule="expected")
    whole = max_batch(full, work, hw, None, NO_HEADROOM, BIG, kv_rule="expected")
    assert windowed / whole == pytest.approx(1 / share, rel=0.02)
    assert max_batch(oss, work, hw, None, NO_HEADROOM, BIG, kv_rule="max") == max_batch(
        full, work, hw, None, NO_HEADROOM, BIG, kv_rule="max"
    )
    policy = Policy(256, 256, "cpu", "gpu", 0)
    attention = [estimate(spec, work, hw, policy).stage_seconds["cpu_attention"] for spec in (oss, full)]
    assert attention[0] / attention[1] == pytest.approx(share, rel=0.01)
    assert oss.attended_share(100) == 1.0  # shorter than the window: every layer reads it all


def test_int8_kv_holds_more_sequences_than_bf16_by_the_bytes_ratio() -> None:
    ratio = kv_token_bytes(MIXTRAL, "bfloat16") / kv_token_bytes(MIXTRAL, "int8")
    assert ratio == bytes_per_token("bfloat16", 1, 8, 128) / bytes_per_token("int8", 1, 8, 128) == 256 / 132
    policy = Policy(1024, 64)
    bf16 = estimate(MIXTRAL, Workload(77, 128, 63), T4, policy, kv_dtype="bfloat16")
    int8 = estimate(MIXTRAL, Workload(77, 128, 63), T4, policy, kv_dtype="int8")
    assert int8.kv_host_bytes == pytest.approx(bf16.kv_host_bytes / ratio, rel=1e-12)
    assert int8.stage_work["cpu_attention"][1] == pytest.approx(bf16.stage_work["cpu_attention"][1] / ratio)
    assert bf16.kv_format == "bfloat16" and int8.kv_format == "int8"
    for rule in KV_RULES:  # the sequences: the bytes ratio, less the per-sequence staging
        n = {
            kv: max_batch(MIXTRAL, Workload(77, 128), T4, None, NO_HEADROOM, BIG, kv, kv_rule=rule)
            for kv in ("bfloat16", "int8")
        }
        assert 0.97 * ratio < n["int8"] / n["bfloat16"] <= ratio


def test_the_headroom_is_k_standard_deviations_of_the_batchs_kv() -> None:
    work = Workload(77, 256, 63)
    sd = math.sqrt(63**2 + 256**2 / 12)  # one sequence's: its prompt's and its age's
    for n in (100, 1000, 10_000):
        for z in (1.0, 3.0):
            spare = kv_tokens(n, work, "expected", Headroom(kv_sigmas=z)) - n * work.avg_context
            assert spare == pytest.approx(z * sd * math.sqrt(n), rel=1e-12)
    # relative to the mean it shrinks as 1/sqrt(N): large batches need little
    share = [kv_tokens(n, work, "expected") / (n * work.avg_context) - 1 for n in (100, 400, 1600)]
    assert share[0] == pytest.approx(2 * share[1]) == pytest.approx(4 * share[2])
    # more spread in the prompts: fewer sequences; no headroom: the mean alone
    held = [kv_sequences(10**6, replace(work, prompt_std=s)) for s in (0.0, 63.0, 200.0)]
    assert held == sorted(held, reverse=True) and held[0] > held[-1]
    assert kv_sequences(10**6, work, "expected", NO_HEADROOM) == math.floor(10**6 / work.avg_context)
    # the total never passes every sequence's full context: a few sequences of fixed prompts are the max rule
    fixed = Workload(77, 32)
    assert kv_tokens(2, fixed, "expected") == 2 * fixed.max_context == kv_tokens(2, fixed, "max")
    assert kv_tokens(8, fixed, "expected") < 8 * fixed.max_context
    # what fits is the largest N whose KV (headroom included) fits
    n = kv_sequences(10**6, work)
    assert kv_tokens(n, work) <= 10**6 < kv_tokens(n + 1, work)


def test_the_rule_costs_arrays_as_it_costs_scalars() -> None:
    work = Workload(77.5, 100, 41.0)
    n = np.arange(1, 5000, 7)
    for rule in KV_RULES:
        grid = kv_tokens(n, work, rule, Headroom(), ARRAYS)
        assert grid.tolist() == [kv_tokens(int(i), work, rule) for i in n]  # to the bit


def test_a_host_bound_batch_fits_at_its_largest() -> None:
    work = Workload(77, 256, 63)
    n = max_batch(MIXTRAL, work, T4, None, Headroom(), BIG, "int8")
    fit = [estimate(MIXTRAL, work, T4, Policy(k, 1), kv_dtype="int8") for k in (n, n + 1)]
    assert fit[0].cpu_bytes <= fit[0].cpu_capacity < fit[1].cpu_bytes


@pytest.mark.parametrize("rule", KV_RULES)
def test_the_search_equals_brute_force_under_either_rule(rule: str) -> None:
    mus, n_ubs, work = [1, 2, 3, 4, 8], [1, 2, 3, 5, 8], Workload(24, 16, 10.0)
    for hw in (TOY, TOY.scaled(cpu_memory=0.6)):
        best = optimize(SMALL, work, hw, "float32", mus=mus, n_ubs=n_ubs, kv_dtype="int8", kv_rule=rule)
        ref = brute_force(SMALL, work, hw, mus, n_ubs, "float32", kv_dtype="int8", kv_rule=rule)
        assert ref is not None and best.fits
        assert best.tokens_per_second == pytest.approx(ref.tokens_per_second, rel=1e-12)
        assert replace(best.policy, resident_experts=0) == replace(ref.policy, resident_experts=0)


# the paper's rule reproduces the plans of docs/hrm.md "Plans against the paper" (N, decode tokens/s)
PAPER_RULE_PLANS = {
    ("t4", 32): (4160, 742.3),
    ("t4", 64): (3200, 574.3),
    ("t4", 128): (2176, 395.1),
    ("t4", 256): (1344, 245.4),
    ("l4", 32): (4160, 819.6),
    ("l4", 64): (3200, 634.5),
    ("l4", 128): (2208, 431.7),
    ("l4", 256): (1344, 271.7),
}


def test_the_max_rule_plans_as_before() -> None:
    for (hw, gen), (batch, tokens) in PAPER_RULE_PLANS.items():
        est = optimize(MIXTRAL, Workload(77, gen, 63), PRESETS[hw], kv_rule="max")  # the spread plays no part
        assert (est.policy.batch, round(est.tokens_per_second, 1)) == (batch, tokens), (hw, gen)


@pytest.mark.parametrize(("gen", "batch"), [(32, 4160), (256, 1344)])
def test_the_planner_in_max_mode_plans_as_before(gen: int, batch: int) -> None:
    """`plan --arch mixtral-8x7b --hardware t4`'s batch before the expected-use rule, from the live planner."""
    planner = Planner(MIXTRAL, T4, Workload(77, gen), "bfloat16", 10**9, PlannerConfig(batch_cap=8192), kv_rule="max")
    assert planner.policy.batch == batch
    assert planner.kv_cache_sequences == 10**9 // (77 + gen)  # what the orchestrator logged before


def test_the_planner_plans_by_expected_use_and_learns_the_prompts_spread() -> None:
    host = replace(HOST, cpu_memory=5e9, gpu_memory=5e9)
    tokens = 16 * 96  # 16 sequences of 64 + 32 tokens reserved at their maximum
    reserve = Planner(SPEC, host, Workload(64, 32), "float32", tokens, kv_rule=KV_RULE_FOR_ADMISSION["reserve"])
    need = Planner(SPEC, host, Workload(64, 32), "float32", tokens, kv_rule=KV_RULE_FOR_ADMISSION["need"])
    assert reserve.kv_cache_sequences == 16 and reserve.policy.batch <= 16
    assert need.kv_cache_sequences > 16 and need.policy.batch <= need.kv_cache_sequences
    assert need.estimate.kv_rule == "expected" and reserve.estimate.kv_rule == "max"
    blocks = Planner(SPEC, host, Workload(64, 32), "float32", tokens, kv_block_size=16)
    assert blocks.kv_cache_sequences < need.kv_cache_sequences  # half a block per sequence goes unused
    # requests of 32 and 96 prompt tokens, alternating: mean 64, standard deviation 32
    learner = Planner(SPEC, host, Workload(64, 32), "float32", 10**6)
    for i in range(200):
        learner.observe_request(32 if i % 2 else 96, 32)
    assert learner.workload.prompt_len == pytest.approx(64, abs=4)
    assert learner.workload.prompt_std == pytest.approx(32, rel=0.1)
    with pytest.raises(ValueError, match="kv_rule must be one of expected, max"):
        Planner(SPEC, host, Workload(64, 32), "float32", tokens, kv_rule="reserve")


def plan(*args: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "moe_lightning.cli", "plan", *args], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_compare_paper_prints_both_rules_side_by_side() -> None:
    text = plan("--arch", "mixtral-8x7b", "--compare-paper")
    rows = {}
    for line in text.splitlines():
        # columns: paper N, tok/s, job/s; ours N, g, tok/s, job/s; the ratios (tests/test_hrm_expert_groups.py
        # checks the job columns)
        m = re.match(
            r"(t4|l4)\s+(\d+)\s+(\d+) = \d+ x \d+\s+([\d.]+)\s+[\d.]+\s+(\d+) = \d+ x \d+\s+\d+\s+([\d.]+)\s+"
            r"[\d.]+\s+([\d.]+)x\s+[\d.]+x$",
            line,
        )
        if m:
            hw, gen, n_paper, tps_paper, n_ours, tps_ours, ratio = m.groups()
            rows[hw, int(gen)] = (int(n_paper), float(tps_paper), int(n_ours), float(tps_ours), float(ratio))
    assert set(rows) == set(PAPER_RULE_PLANS), text
    for key, (n_paper, tps_paper, n_ours, tps_ours, ratio) in rows.items():
        assert (n_paper, tps_paper) == PAPER_RULE_PLANS[key]
        assert n_ours > n_paper and ratio == pytest.approx(tps_ours / tps_paper, abs=0.01)
    assert rows["t4", 256][4] >= 1.5  # the bar: 8-bit KV by expected use at gen 256 on a T4
    assert "bfloat16 at the maximum context" in text and "int8 by expected use" in text
    out = json.loads(plan("--arch", "mixtral-8x7b", "--compare-paper", "--json"))
    t4_256 = next(r for r in out["rows"] if r["hardware"] == "t4" and r["gen_len"] == 256)
    assert t4_256["paper"]["batch_size"] == 1344 and t4_256["ratio"] >= 1.5
    assert (t4_256["paper"]["kv_rule"], t4_256["ours"]["kv_rule"]) == ("max", "expected")
    assert (t4_256["paper"]["kv_format"], t4_256["ours"]["kv_format"]) == ("bfloat16", "int8")


def test_plan_reports_the_rule_it_planned_by() -> None:
    assert KV_RULE_CHOICES == KV_RULES
    args = ("--arch", "mixtral-8x7b", "--hardware", "t4", "--gen-len", "256")
    ours, paper = json.loads(plan(*args, "--json")), json.loads(plan(*args, "--json", "--kv-rule", "max"))
    assert paper["policy"]["batch_size"] == 1344 and ours["policy"]["batch_size"] > 1344
    assert ours["kv_rule"] == ours["kv_cache"]["rule"] == "expected" and paper["kv_rule"] == "max"
    assert ours["kv_cache"]["tokens_per_sequence"] == 77 + 128 and paper["kv_cache"]["tokens_per_sequence"] == 333
    assert ours["prompt_std"] == 63 and ours["kv_cache"]["headroom_tokens"] > 0
    assert ours["kv_cache"]["sequences"] > paper["kv_cache"]["sequences"]
    text = plan(*args)
    assert f"the host holds {ours['kv_cache']['sequences']:,} sequences of 205 tokens on average" in text
    int8 = json.loads(plan(*args, "--json", "--kv-dtype", "int8"))
    assert int8["kv_format"] == int8["kv_cache"]["dtype"] == "int8"
    assert int8["kv_cache"]["bytes_per_sequence"] == kv_token_bytes(MIXTRAL, "int8") * MIXTRAL.num_layers * 205
    assert int8["kv_cache"]["sequences"] > 1.9 * ours["kv_cache"]["sequences"]
