"""The hierarchical roofline model: properties of the cost model and the policy search."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from hrm_reference import SMALL, TOY

from moe_lightning.config.choices import DTYPE_NAMES
from moe_lightning.hrm.archs import ARCHS
from moe_lightning.hrm.costmodel import Policy, estimate
from moe_lightning.hrm.hardware import GB, PRESETS, load_profile
from moe_lightning.hrm.layercost import DTYPE_BYTES, Workload
from moe_lightning.hrm.optimizer import brute_force, optimize
from moe_lightning.kv_format import KV_FORMATS
from moe_lightning.spec import ModelSpec

WORK = Workload(24, 16)


def test_optimizer_equals_brute_force_on_small_grids() -> None:
    mus, n_ubs = [1, 2, 3, 4, 8], [1, 2, 3, 5, 8]
    for hw in (TOY, TOY.scaled(gpu_memory=0.5), TOY.scaled(h2d_bandwidth=20), TOY.scaled(cpu_bandwidth=0.1)):
        best = optimize(SMALL, WORK, hw, "float32", mus=mus, n_ubs=n_ubs)
        ref = brute_force(SMALL, WORK, hw, mus, n_ubs, "float32")
        assert ref is not None
        assert best.tokens_per_second == pytest.approx(ref.tokens_per_second, rel=1e-12), hw
        # ties in throughput may differ only in how many experts are resident (memory that is free anyway)
        assert replace(best.policy, resident_experts=0) == replace(ref.policy, resident_experts=0)


def host_bytes(spec: ModelSpec) -> float:
    """416 GB (the paper's host), or what a bigger model's bf16 weights need with room for a KV cache."""
    return max(416e9, 3.0 * 2 * spec.num_parameters())


# the smallest GPU whose memory holds a model's bf16 dense weights and a micro-batch's activations
DENSE_FITS = {"qwen3-235b-a22b": "l4", "glm-4.5-air": "l4", "glm-4.5": "h100", "deepseek-v3": "h100"}


# every family on the T4 (the memory-bound case) or the smallest GPU its dense weights fit (DENSE_FITS),
# two on the H100 (each case runs three searches)
@pytest.mark.parametrize(
    ("arch", "hw"),
    [(a, DENSE_FITS.get(a, "t4")) for a in ARCHS] + [("mixtral-8x7b", "h100"), ("qwen3-30b-a3b", "h100")],
)
def test_more_device_memory_or_link_bandwidth_never_lowers_throughput(arch: str, hw: str) -> None:
    spec, base = ARCHS[arch], PRESETS[hw].scaled(cpu_memory=host_bytes(ARCHS[arch]) / PRESETS[hw].cpu_memory)
    work = Workload(77, 64)
    previous = optimize(spec, work, base).tokens_per_second
    more_mem = optimize(spec, work, base.scaled(gpu_memory=4.0)).tokens_per_second
    more_link = optimize(spec, work, base.scaled(h2d_bandwidth=4.0, d2h_bandwidth=4.0)).tokens_per_second
    assert more_mem >= previous * (1 - 1e-9) and more_link >= previous * (1 - 1e-9)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("gen", [32, 256])
def test_returned_policy_fits_both_memories_and_names_the_binding_resource(arch: str, gen: int) -> None:
    hw = PRESETS["t4"].with_gpus(4).scaled(cpu_memory=host_bytes(ARCHS[arch]) / PRESETS["t4"].cpu_memory)
    est = optimize(ARCHS[arch], Workload(77, gen), hw)
    assert est.fits
    assert est.gpu_bytes <= est.gpu_capacity and est.cpu_bytes <= est.cpu_capacity
    assert est.binding == max(est.resource_seconds, key=est.resource_seconds.get)
    assert est.layer_seconds >= max(est.resource_seconds.values())


def test_cost_model_terms() -> None:
    """The link streams exactly the non-resident experts; attention bytes are the KV read."""
    spec, hw = ARCHS["mixtral-8x7b"], PRESETS["t4"]
    work = Workload(77, 32)
    expert = 3 * 4096 * 14336 * 2
    est = estimate(spec, work, hw, Policy(64, 16, resident_experts=32))  # one expert per layer resident
    assert est.stage_seconds["link_weights"] == pytest.approx(7 * expert / hw.h2d_bandwidth)
    kv = 64 * work.avg_context * 2 * 8 * 128 * 2
    assert est.stage_seconds["cpu_attention"] == pytest.approx(kv / hw.cpu_bandwidth)
    on_gpu = estimate(spec, work, hw, Policy(64, 16, attention="gpu", kv_gpu_fraction=0.0))
    assert on_gpu.stage_seconds["link_kv"] == pytest.approx(kv / hw.h2d_bandwidth)
    assert on_gpu.stage_seconds["link_kv"] > est.stage_seconds["cpu_attention"]  # why attention lives on the CPU
    shared = replace(hw, shared_host_device=True)
    one = estimate(spec, work, shared, Policy(64, 16))
    assert one.resource_seconds["link"] == 0 and one.layer_seconds == pytest.approx(
        one.resource_seconds["gpu"] + one.resource_seconds["cpu"]
    )


def test_dense_layers_count_as_dense_work() -> None:
    """Half the layers dense (Qwen-MoE's decoder_sparse_step 2): the experts' compute and the streamed
    bytes halve, the dense MLPs join the always-resident weights, the memory is the model's size."""
    sparse = ARCHS["qwen3-30b-a3b"]
    half = replace(sparse, dense_layers=tuple(range(0, sparse.num_layers, 2)), dense_intermediate_size=6144)
    work, hw, policy = Workload(77, 32), PRESETS["t4"], Policy(64, 16)
    a, b = estimate(sparse, work, hw, policy), estimate(half, work, hw, policy)
    assert b.stage_work["gpu_experts"][0] == pytest.approx(a.stage_work["gpu_experts"][0] / 2)
    assert b.stage_seconds["link_weights"] == pytest.approx(a.stage_seconds["link_weights"] / 2)
    dense_mlp = 2 * 64 * 3 * 2048 * 6144 / 2  # per layer, averaged: half the layers have one
    assert b.stage_work["gpu_dense"][0] - a.stage_work["gpu_dense"][0] == pytest.approx(
        dense_mlp - 2 * 64 * 2048 * 128 / 2  # ... and half the routers are gone
    )
    for spec, est in ((sparse, a), (half, b)):  # host memory: the weights (within norms) plus KV
        weights = est.cpu_bytes - est.kv_host_bytes - 64 * (2 * spec.q_size + 2 * spec.kv_size) * 2 * 2
        assert weights == pytest.approx(spec.num_parameters() * 2, rel=1e-3)
    assert optimize(half, work, hw.with_gpus(4)).fits


def test_nothing_fits_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="do not fit in 80% of host memory"):
        optimize(ARCHS["mixtral-8x22b"], Workload(77, 32), PRESETS["t4"])


@pytest.mark.parametrize("dtypes", [{"dtype": "auto"}, {"kv_dtype": "auto"}, {"dtype": "int8"}])
def test_an_unresolved_dtype_is_a_clear_error(dtypes: dict[str, str]) -> None:
    """'auto' is resolved by device before planning (the commands' job): the model names what it takes."""
    spec, work, hw = ARCHS["mixtral-8x7b"], Workload(77, 32), PRESETS["t4"]
    allowed = ", ".join(KV_FORMATS if "kv_dtype" in dtypes else DTYPE_NAMES)  # a KV cache may also be int8
    with pytest.raises(ValueError, match=f"one of {allowed}; got '{next(iter(dtypes.values()))}'"):
        estimate(spec, work, hw, Policy(8, 8), **dtypes)
    with pytest.raises(ValueError, match=f"resolved {next(iter(dtypes))}, one of {allowed}"):
        optimize(spec, work, hw, **dtypes)
    assert tuple(DTYPE_BYTES) == DTYPE_NAMES  # the model knows every dtype a flag may name


def test_mixtral_8x22b_plans_in_under_a_second() -> None:
    hw = PRESETS["t4"].with_gpus(4).scaled(cpu_memory=416e9 / 192e9)
    t0 = time.perf_counter()
    optimize(ARCHS["mixtral-8x22b"], Workload(77, 32), hw)
    assert time.perf_counter() - t0 < 1.0


def test_profiles_load_from_presets_and_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "box.json"
    path.write_text(PRESETS["l4"].to_json())
    assert load_profile(str(path)).gpu_memory == 24 * GB
    with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
        load_profile("tpu")
    assert PRESETS["t4"].with_gpus(4).gpu_memory == 4 * PRESETS["t4"].gpu_memory


def test_plan_cli(tmp_path) -> None:  # type: ignore[no-untyped-def]
    def plan(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "moe_lightning.cli", "plan", *args], capture_output=True, text=True, timeout=60
        )

    r = plan("--arch", "mixtral-8x7b", "--hardware", "t4", "--prompt-len", "77", "--gen-len", "32", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["policy"]["attention"] == "cpu" and out["policy"]["experts"] == "gpu"
    assert out["binding_resource"] in ("gpu", "cpu", "link") and out["predicted_decode_tokens_per_second"] > 0
    text = plan("--arch", "dbrx", "--hardware", "t4", "--gpus", "4", "--host-memory", "416GB")
    assert text.returncode == 0, text.stderr
    assert "bound by" in text.stdout and "policy" in text.stdout
    png = tmp_path / "roof.png"
    drawn = plan("--arch", "mixtral-8x7b", "--hardware", "l4", "--plot", str(png))
    assert drawn.returncode == 0, drawn.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    bad = plan("--arch", "gpt5", "--hardware", "t4")
    assert bad.returncode == 2 and "unknown --arch" in bad.stderr


def test_calibration_measures_positive_roofs_and_caches(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from moe_lightning.hrm.calibrate import cached_profile

    first = cached_profile(SMALL, "cpu", cache_dir=tmp_path)
    assert first.shared_host_device and first.source == "calibrated"
    for roof in ("gpu_flops", "gpu_bandwidth", "cpu_flops", "cpu_bandwidth", "h2d_bandwidth", "cpu_memory"):
        assert getattr(first, roof) > 0, roof
    assert 1e8 < first.gpu_flops < 1e15  # a real matmul rate, not a default
    # the profile, and the host's issue time every model's profile shares (hrm/calibrate.py, cached_host_issue)
    issue = list(tmp_path.glob("*-host_issue-*.json"))
    cached = [f for f in tmp_path.glob("*.json") if f not in issue]
    assert len(cached) == 1 and len(issue) == 1
    again = cached_profile(SMALL, "cpu", cache_dir=tmp_path)
    assert again.gpu_flops == first.gpu_flops and again.source == str(cached[0])  # read back, not re-measured
    plan = optimize(SMALL, WORK, again, "float32", batch_cap=64)
    assert plan.policy.attention == "cpu" and plan.resource_seconds["link"] == 0


def test_attention_calibration_takes_a_spec_with_dense_layers(tiny_model: Path) -> None:
    """It measures on a one-layer copy of the spec; a Qwen-style dense layer index must not leak into
    it (a fresh machine failed at cpu_attention's start for such a model)."""
    import dataclasses

    from moe_lightning.hrm.calibrate import attention_bandwidth

    spec = dataclasses.replace(
        ModelSpec.from_pretrained(tiny_model), num_layers=3, dense_layers=(1,), dense_intermediate_size=96
    )
    assert attention_bandwidth(spec, batch=2, context=32, repeats=1) > 0
