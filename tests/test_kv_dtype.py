"""The host KV cache's dtype in the HRM: its bytes, the batch the host holds, the planner, `plan`."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from host_profile import HOST, SPEC

from moe_lightning.demo_model import mixtral_config
from moe_lightning.hrm.archs import ARCHS
from moe_lightning.hrm.costmodel import Policy, estimate
from moe_lightning.hrm.hardware import PRESETS
from moe_lightning.hrm.layercost import Headroom, Workload
from moe_lightning.hrm.optimizer import max_batch, optimize
from moe_lightning.spec import ModelSpec
from moe_lightning.step_protocol import StepKind, StepTimings
from orchestrator.planner import Planner

MIXTRAL = ARCHS["mixtral-8x7b"]
T4 = PRESETS["t4"]
MTBENCH = Workload(77, 32)  # 109 tokens per sequence at the end


def test_host_kv_bytes_follow_the_kv_dtype_not_the_weights() -> None:
    """The paper's T4 point: 3,116 sequences of ~109 tokens are ~89 GB of fp32 KV, ~45 GB of bf16 (the
    paper's rule: every sequence at its maximum context)."""
    policy = Policy(3116, 82)
    fp32 = estimate(MIXTRAL, MTBENCH, T4, policy, "bfloat16", kv_dtype="float32", kv_rule="max")
    bf16 = estimate(MIXTRAL, MTBENCH, T4, policy, "bfloat16", kv_dtype="bfloat16", kv_rule="max")
    assert fp32.kv_host_bytes == pytest.approx(89.0e9, rel=0.01)
    assert bf16.kv_host_bytes == pytest.approx(fp32.kv_host_bytes / 2)
    assert fp32.cpu_bytes - bf16.cpu_bytes == pytest.approx(bf16.kv_host_bytes)  # nothing else changed
    assert bf16.stage_work["cpu_attention"][1] == pytest.approx(fp32.stage_work["cpu_attention"][1] / 2)
    assert fp32.gpu_bytes == bf16.gpu_bytes  # the device's share is in the weights' dtype either way
    default = estimate(MIXTRAL, MTBENCH, T4, policy, "bfloat16", kv_rule="max")  # no KV dtype named: the weights'
    assert default.cpu_bytes == bf16.cpu_bytes and default.tokens_per_second == bf16.tokens_per_second


def test_a_16_bit_cache_holds_about_twice_the_batch() -> None:
    n32 = max_batch(MIXTRAL, MTBENCH, T4, "bfloat16", Headroom(), 10**9, "float32")
    n16 = max_batch(MIXTRAL, MTBENCH, T4, "bfloat16", Headroom(), 10**9, "bfloat16")
    assert 1.9 < n16 / n32 <= 2.0  # per sequence also some hand-off staging, in the weights' dtype
    assert max_batch(MIXTRAL, MTBENCH, T4, "bfloat16", Headroom(), 10**9) == n16
    assert optimize(MIXTRAL, MTBENCH, T4, "bfloat16", kv_dtype="float32").policy.batch <= n32


def test_planner_plans_with_the_attention_services_kv_dtype() -> None:
    spec = SPEC
    host = replace(HOST, gpu_memory=5e9, cpu_memory=5e9)  # a small machine: the KV cache bounds the batch
    plans = {
        kv: Planner(spec, host, Workload(64, 32), "float32", 10**7, kv_dtype=kv, kv_rule="max")
        for kv in ("float32", "bfloat16")
    }
    assert Planner(spec, host, Workload(64, 32), "float32", 10**7).kv_dtype == "float32"  # default: the weights'
    per_seq = {kv: p.estimate.kv_host_bytes / p.policy.batch for kv, p in plans.items()}
    assert per_seq["bfloat16"] == pytest.approx(per_seq["float32"] / 2)
    assert per_seq["float32"] == 2 * spec.kv_size * 4 * spec.num_layers * 96  # 64 + 32 tokens
    p = plans["bfloat16"]  # predictions after a step use the same dtype
    timings = StepTimings(StepKind.DECODE, pre_attention=10**6, post_attention=10**7, attention_busy=10**6)
    p.observe_step(p.policy.batch, p.policy.micro_batch_size, timings)
    assert p.estimate.kv_host_bytes / p.policy.batch == per_seq["bfloat16"]


def test_plan_json_reports_the_sequences_the_host_kv_cache_holds() -> None:
    def plan(*extra: str) -> dict:
        args = ["--arch", "mixtral-8x7b", "--hardware", "t4", "--prompt-len", "77", "--gen-len", "32", *extra]
        args += ["--kv-rule", "max"]  # each sequence at s + n: 109 tokens
        r = subprocess.run(
            [sys.executable, "-m", "moe_lightning.cli", "plan", *args], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout) if "--json" in extra else {"text": r.stdout}

    bf16 = plan("--json")["kv_cache"]  # default: the weights' dtype
    fp32 = plan("--json", "--kv-dtype", "float32")["kv_cache"]
    assert bf16["dtype"] == "bfloat16" and fp32["dtype"] == "float32"
    assert bf16["tokens_per_sequence"] == 109 and bf16["bytes_per_sequence"] == fp32["bytes_per_sequence"] / 2
    assert bf16["bytes_per_sequence"] == 2 * MIXTRAL.kv_size * 2 * MIXTRAL.num_layers * 109
    assert 1.9 < bf16["sequences"] / fp32["sequences"] <= 2.0
    assert f"the host holds {bf16['sequences']:,} sequences of 109 tokens in bfloat16" in plan()["text"]


def test_attention_calibration_counts_the_caches_own_bytes() -> None:
    from moe_lightning.hrm.calibrate import attention_bandwidth

    spec = replace(ModelSpec.from_hf_config(mixtral_config("tiny")), dense_layers=(1,), dense_intermediate_size=32)
    for dtype in (torch.float32, torch.bfloat16):
        assert attention_bandwidth(spec, batch=2, context=32, repeats=1, dtype=dtype) > 0
