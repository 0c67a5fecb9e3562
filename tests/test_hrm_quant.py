"""The HRM with quantized expert pages: what the link, the memories and the expert GEMM see, the plans
it makes, `plan --quantize` and calibration on quantized experts."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from host_profile import HOST, SPEC

from moe_lightning.demo_model import mixtral_config
from moe_lightning.hrm.archs import ARCHS
from moe_lightning.hrm.costmodel import Policy, estimate
from moe_lightning.hrm.hardware import PRESETS, HardwareProfile
from moe_lightning.hrm.layercost import Workload, weight_bytes
from moe_lightning.hrm.optimizer import brute_force, optimize
from moe_lightning.quant import kernels
from moe_lightning.quant.rtn import quantize
from moe_lightning.quant.scheme import QuantFormat, QuantScheme
from moe_lightning.spec import ModelSpec
from moe_lightning.step_protocol import StepKind, StepTimings
from moe_lightning.weights import ExpertWeights
from orchestrator.planner import Planner, PlannerConfig

MIXTRAL, MTBENCH = ARCHS["mixtral-8x7b"], Workload(77, 32)
INT8, INT4 = QuantScheme(QuantFormat.INT8), QuantScheme(QuantFormat.INT4, 128)


def page_bpw(scheme: QuantScheme, h1: int = 4096, h2: int = 14336, b: int = 2) -> float:
    return (2 * scheme.bytes_per_weight(h1, b) + scheme.bytes_per_weight(h2, b)) / 3


@pytest.mark.parametrize("scheme", [INT8, INT4, QuantScheme(QuantFormat.INT4, 32)])
def test_quantized_pages_cut_link_bytes_and_host_memory_by_bytes_per_weight(scheme: QuantScheme) -> None:
    policy = Policy(64, 16, resident_experts=32)  # one expert per layer resident: 7 stream per layer
    dense = estimate(MIXTRAL, MTBENCH, PRESETS["t4"], policy)
    quant = estimate(MIXTRAL, MTBENCH, PRESETS["t4"], policy, quant=scheme)
    ratio = page_bpw(scheme) / 2
    assert quant.page_bytes == pytest.approx(3 * 4096 * 14336 * page_bpw(scheme))
    assert quant.link_bytes["link_weights"] == pytest.approx(7 * quant.page_bytes)
    assert quant.link_bytes["link_weights"] / dense.link_bytes["link_weights"] == pytest.approx(ratio)
    assert quant.stage_seconds["link_weights"] / dense.stage_seconds["link_weights"] == pytest.approx(ratio)
    # activations over the link, the KV cache and the dense weights do not change
    assert quant.link_bytes["link_qkv"] == dense.link_bytes["link_qkv"]
    assert quant.kv_host_bytes == dense.kv_host_bytes
    assert weight_bytes(MIXTRAL, 2, scheme)["layer_dense"] == weight_bytes(MIXTRAL, 2)["layer_dense"]
    saved = 256 * (dense.page_bytes - quant.page_bytes)  # every expert page is on the host
    assert dense.cpu_bytes - quant.cpu_bytes == pytest.approx(saved)


def test_expert_gemm_kernel_follows_the_device() -> None:
    """T4 dequantizes then multiplies (25 bytes moved per weight in bf16, the eager passes); 8.0+ runs
    int4 tinygemm when weight-bound; an unquantized page reads its 2 bytes."""
    policy = Policy(64, 16, resident_experts=256)
    t4 = estimate(MIXTRAL, MTBENCH, PRESETS["t4"], policy, quant=INT4)
    l4 = estimate(MIXTRAL, MTBENCH, PRESETS["l4"], policy, quant=INT4)
    dense = estimate(MIXTRAL, MTBENCH, PRESETS["l4"], policy)
    assert t4.kernels == {"gpu_experts": "dequant_mm"} and l4.kernels == {"gpu_experts": "int4mm_cuda"}
    weights = dense.stage_work["gpu_experts"][1] / 2
    assert t4.stage_work["gpu_experts"][1] == pytest.approx(25 * weights)
    assert l4.stage_work["gpu_experts"][1] == pytest.approx((1.5 + 4 * (page_bpw(INT4) - 0.5)) * weights)
    assert l4.stage_seconds["gpu_experts"] < dense.stage_seconds["gpu_experts"] < t4.stage_seconds["gpu_experts"]
    # at large micro-batches the tensor-core GEMM after dequantizing wins over tinygemm
    assert estimate(MIXTRAL, MTBENCH, PRESETS["l4"], Policy(8192, 8192), quant=INT4).kernels["gpu_experts"] == (
        "dequant_mm"
    )


def test_measured_expert_roofs_replace_the_table_for_their_format_only() -> None:
    hw = replace(HOST, expert_format="int8", expert_flops=1e13, expert_bandwidth=1e9)
    policy = Policy(16, 16)
    est = estimate(SPEC, Workload(64, 32), hw, policy, "float32", quant=INT8)
    touched = est.stage_work["gpu_experts"]
    assert est.kernels["gpu_experts"] == "measured"
    pages = touched[1] / hw.gpu_bandwidth * hw.expert_bandwidth  # back in page bytes
    assert est.stage_seconds["gpu_experts"] == pytest.approx(pages / 1e9)  # weight-bound at 16 rows
    other = estimate(SPEC, Workload(64, 32), hw, policy, "float32", quant=QuantScheme(QuantFormat.INT4, 128))
    assert other.kernels["gpu_experts"] == "int4_host"  # measured int8, planned int4: the table's CPU kernel


@pytest.mark.parametrize("scheme", [INT8, QuantScheme(QuantFormat.INT4, 32)])
def test_optimizer_equals_brute_force_with_quantized_pages(scheme: QuantScheme) -> None:
    """Memory stays linear in the resident pages (the closed form holds) whatever their size."""
    small = ModelSpec.from_hf_config(mixtral_config("tiny"))
    toy = HardwareProfile("toy", 2e9, 4e9, 1.5e6, 4e8, 1e9, 40e6, 2e8, 2e8, compute_capability=8.0)
    mus, n_ubs, work = [1, 2, 4, 8], [1, 2, 3, 5], Workload(24, 16)
    for hw in (toy, toy.scaled(gpu_memory=0.5), toy.scaled(h2d_bandwidth=20)):
        best = optimize(small, work, hw, "float32", mus=mus, n_ubs=n_ubs, quant=scheme)
        ref = brute_force(small, work, hw, mus, n_ubs, "float32", quant=scheme)
        assert ref is not None and best.tokens_per_second == pytest.approx(ref.tokens_per_second, rel=1e-12)


@pytest.mark.parametrize("hw", ["t4", "l4"])
def test_smaller_pages_keep_more_experts_resident_and_a_larger_batch(hw: str) -> None:
    """On T4/L4 device memory limits the resident pages and host memory the batch: both grow."""
    work = Workload(77, 256)  # smaller batches than at 32 generated: a quicker search, the same story
    plans = {q.format: optimize(MIXTRAL, work, PRESETS[hw], quant=q) for q in (QuantScheme(), INT8, INT4)}
    none, int8, int4 = plans[QuantFormat.NONE], plans[QuantFormat.INT8], plans[QuantFormat.INT4]
    assert none.gpu_bytes > 0.97 * none.gpu_capacity  # device memory was binding
    assert none.policy.resident_experts < int8.policy.resident_experts < int4.policy.resident_experts
    assert none.policy.batch < int8.policy.batch <= int4.policy.batch
    assert all(p.fits for p in plans.values())
    assert min(int8.tokens_per_second, int4.tokens_per_second) > 1.5 * none.tokens_per_second


def test_planner_plans_with_the_stack_page_format() -> None:
    dense = Planner(SPEC, HOST, Workload(64, 32), "float32", kv_tokens=10**6)
    int8 = Planner(SPEC, HOST, Workload(64, 32), "float32", kv_tokens=10**6, quant=INT8)
    assert int8.estimate.quant == INT8 and dense.estimate.quant == QuantScheme()
    assert int8.estimate.page_bytes == pytest.approx(dense.estimate.page_bytes * page_bpw(INT8, 1024, 3584, 4) / 4)


def test_online_correction_scales_the_measured_expert_roofs() -> None:
    hw = replace(HOST, expert_format="int8", expert_flops=5e10, expert_bandwidth=1e9)
    p = Planner(SPEC, hw, Workload(64, 32), "float32", kv_tokens=10**6, config=PlannerConfig(patience=3), quant=INT8)
    batch = p.policy.micro_batch_size
    s = estimate(SPEC, p.workload, hw, Policy(batch, batch), "float32", quant=INT8).stage_seconds
    device = 2 * (s["gpu_dense"] + s["gpu_experts"]) * SPEC.num_layers  # the device runs at half the speed
    slow = StepTimings(StepKind.DECODE, pre_attention=int(0.1 * device * 1e9), post_attention=int(0.9 * device * 1e9))
    for _ in range(5):
        p.observe_step(batch, batch, slow)
    assert p.profile.expert_bandwidth == pytest.approx(hw.expert_bandwidth / 2, rel=0.15)
    assert p.profile.expert_bandwidth / p.profile.gpu_bandwidth == pytest.approx(1e9 / hw.gpu_bandwidth)


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moe_lightning.cli", "plan", "--arch", "mixtral-8x7b", "--gen-len", "256", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_plan_cli_quantize() -> None:
    text = _plan("--hardware", "t4", "--quantize", "int4")
    assert text.returncode == 0, text.stderr
    for words in ("pages in int4, groups of 128", "MB each", "GB per decode step", "expert pages resident", "tokens/s"):
        assert words in text.stdout, words
    compare = _plan("--hardware", "l4", "--compare-quantize", "--json")
    assert compare.returncode == 0, compare.stderr
    plans = json.loads(compare.stdout)["plans"]
    assert [p["expert_pages"]["format"] for p in plans] == ["none", "int8", "int4", "mxfp4"]
    pages = [p["expert_pages"]["bytes_per_page"] for p in plans]
    steps = [p["link_bytes_per_step"]["total"] for p in plans]
    # mxfp4's 4.25 bits a weight under int4's 4.5 (its scale and zero per 128 in fp32)
    assert pages[0] > pages[1] > pages[2] > pages[3] and steps[0] > steps[2]
    bad = _plan("--hardware", "t4", "--quantize", "int4", "--quantize-group-size", "100")
    assert bad.returncode == 2 and "--quantize-group-size" in bad.stderr
    # under --compare-quantize the group size is int4's: mxfp4 keeps its block of 32, not refused
    g64 = _plan("--hardware", "l4", "--compare-quantize", "int4,mxfp4", "--quantize-group-size", "64", "--json")
    assert g64.returncode == 0, g64.stderr
    assert [p["expert_pages"]["group_size"] for p in json.loads(g64.stdout)["plans"]] == [64, None]  # its own
    alone = _plan("--hardware", "t4", "--quantize", "mxfp4", "--quantize-group-size", "64")
    assert alone.returncode == 2 and "mxfp4 has one scale per 32" in alone.stderr


@pytest.fixture
def dequant_only() -> Iterator[None]:
    """One kernel, so the chooser does not time every candidate (seconds on the 2-core box)."""
    kernels.configure(only="dequant_mm")
    yield
    kernels.configure()


def test_calibration_on_quantized_experts(dequant_only: None) -> None:
    from moe_lightning.hrm.calibrate import expert_side_key, measure_expert_side
    from moe_lightning.hrm.kernels import measured
    from moe_lightning.hrm.pages import page_nbytes
    from moe_lightning.hrm.roofs import Measurements as M
    from moe_lightning.hrm.roofs import profile_from
    from moe_lightning.service.convert import measurements_from_pb, measurements_to_pb

    scheme = QuantScheme(QuantFormat.INT4, 32)
    gen = torch.Generator().manual_seed(0)
    experts = [
        ExpertWeights(
            quantize(torch.randn(128, 64, generator=gen), scheme), quantize(torch.randn(64, 64, generator=gen), scheme)
        )
        for _ in range(2)
    ]
    w13 = experts[0].w13
    assert page_nbytes(experts[0]) == sum(
        t.numel() * t.element_size() for t in (*w13.tensors(), *experts[0].w2.tensors())
    )
    with pytest.raises(ValueError, match="pass dtype"):
        measure_expert_side(experts, "cpu", 1e9)
    m = measure_expert_side(experts, "cpu", 1e9, dense=[torch.randn(64, 64)])  # the dtype: the dense weights'
    assert m.expert_format == "int4-g32" and m.expert_format == scheme.key()
    assert m.expert_stream_bandwidth > 0 and m.expert_matmul_flops > 0 and m.weight_stream_bandwidth > 0
    assert measurements_from_pb(measurements_to_pb(m)) == m  # it reaches the orchestrator whole
    hw = profile_from(m, M(matmul_flops=1e9, attention_bandwidth=1e9, memory_bytes=1e10))
    assert (hw.expert_format, hw.expert_bandwidth) == ("int4-g32", m.expert_stream_bandwidth)
    unquantized = measure_expert_side([ExpertWeights(torch.randn(128, 64), torch.randn(64, 64))], "cpu", 1e9)
    # unquantized pages: the expert GEMM's own rate too (the stream rate is the weights' own)
    assert unquantized.expert_format == "none" and unquantized.expert_matmul_flops > 0
    assert unquantized.expert_stream_bandwidth == unquantized.weight_stream_bandwidth > 0
    side = M(matmul_flops=1e9, attention_bandwidth=1e9, memory_bytes=1e10)
    assert measured(profile_from(unquantized, side), QuantScheme())
    key = expert_side_key("cuda:0", torch.bfloat16, SPEC, scheme)
    assert key == "gpu_expert-cuda0-torch.bfloat16-1024x3584-int4-g32"
    assert expert_side_key("cpu", torch.float32, SPEC, QuantScheme()) == "gpu_expert-cpu-torch.float32-1024x3584"
