"""The benchmark command on the tiny model: it runs every configuration and reports ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from moe_lightning.benchmark import mtbench_lengths
from moe_lightning.spec import ModelSpec

from reference import device_budget


def test_mtbench_lengths_follow_the_published_statistics() -> None:
    lengths = mtbench_lengths(256)
    assert abs(sum(lengths) / len(lengths) - 77) < 1 and max(lengths) == 418 and min(lengths) >= 4
    assert mtbench_lengths(64) == mtbench_lengths(64)  # deterministic


def test_bench_runs_ours_and_both_baselines(tiny_model: Path, tmp_path: Path) -> None:
    spec = ModelSpec.from_pretrained(tiny_model)
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_lightning.cli",
            "bench",
            "--model",
            str(tiny_model),
            "--num-prompts",
            "6",
            "--gen-len",
            "4",
            "--micro-batch-size",
            "2",
            "--device-memory",  # streams: the resident and copy reference runs join in
            str(device_budget(tiny_model, spec.num_experts)),
            "--skip-alternating",  # (d) runs in the link test below
            "--json-out",
            str(out),
            "--trace",
            str(tmp_path / "t.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    for key in ("ours", "overlap_off", "transformers", "resident", "streamed", "overlap_off_streamed"):
        assert res[key]["generated_tokens_per_second"] > 0, key
    assert res["ours"]["policy"]["experts"] == "cpu"  # a CPU "device": the HRM computes experts in place
    assert res["ours"]["expert_bytes_streamed"] == 0 and res["streamed"]["expert_bytes_streamed"] > 0
    assert res["overlap_off"]["policy"]["experts"] == "cpu"  # (b) runs at the same placement
    assert res["roofline_decode_tokens_per_second"] > 0
    assert set(res["ours"]["timeline"]["busy_fraction"]) >= {"device", "cpu"}
    assert "(a) transformers generate" in r.stdout and "(b) overlap off" in r.stdout
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    # HRM predicted vs measured per stage, per layer of a decode step
    stages = res["stages_per_layer"]
    assert set(stages) == {
        "device: dense + experts",
        "attention",
        "head",
        "expert copy (exposed wait)",
        "layer (the step / L)",
    }
    for name in ("device: dense + experts", "attention", "head", "layer (the step / L)"):
        assert stages[name]["predicted"] > 0 and stages[name]["measured"] > 0, name
    # gpu_expert's own stages fit in the step (attention, in the other process, may overlap them)
    own = stages["device: dense + experts"]["measured"] + stages["head"]["measured"]
    assert own <= stages["layer (the step / L)"]["measured"]
    assert "HRM predicted vs measured" in r.stdout


def test_bench_compares_expert_formats_in_both_placements(tiny_model: Path, tmp_path: Path) -> None:
    """`bench --compare-quantize none,int8,int4`: each format streamed at the dense weights plus 60 % of its
    expert pages (fewer bytes per step the smaller the page), and computed in place (none streamed)."""
    out = tmp_path / "formats.json"
    argv = [sys.executable, "-m", "moe_lightning.cli", "bench", "--model", str(tiny_model), "--num-prompts", "4"]
    argv += ["--gen-len", "3", "--device-memory", "60%", "--compare-quantize", "none,int8,int4"]  # 4 of 8: one layer
    argv += ["--quantize-group-size", "32", "--json-out", str(out)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    streamed, in_place = res["formats"], res["formats_in_place"]
    assert [streamed[f]["policy"]["experts"] for f in ("none", "int8", "int4")] == ["gpu"] * 3
    assert [in_place[f]["policy"]["experts"] for f in ("none", "int8", "int4")] == ["cpu"] * 3
    per_step = [streamed[f]["expert_bytes_per_step"] for f in ("none", "int8", "int4")]
    assert per_step[0] > per_step[1] > per_step[2] > 0
    assert streamed["int8"]["ratios"]["bytes_per_step_reduction"] > 3.5  # int8 pages against fp32's
    assert all(in_place[f]["expert_bytes_streamed"] == 0 for f in in_place)
    assert set(streamed["int4"]["kernels"]) == {"256x64", "64x128"}  # w13 and w2 of the tiny model
    # fp32 experts on a CPU: the dense GEMMs raced for them are reported too
    assert {"256x64", "64x128"} <= set(in_place["none"]["dense_kernels"]), in_place["none"]["dense_kernels"]
    assert "experts streamed (ratios against none)" in r.stdout and "computed in place" in r.stdout


def test_bench_behind_a_simulated_link_reports_the_hrms_layer_error(tiny_model: Path, tmp_path: Path) -> None:
    """`bench --link-bandwidth`: every stack streams its experts over the simulated link; the HRM plans
    and predicts with that link, for ours and for (b), whose times add up. Purely link-bound here (the
    tiny model computes a layer in a few ms, its link takes ~40), so both predictions are the link's
    time: the error only measures what the simulation and the schedule add to it."""
    spec = ModelSpec.from_pretrained(tiny_model)
    out = tmp_path / "link.json"
    argv = [sys.executable, "-m", "moe_lightning.cli", "bench", "--model", str(tiny_model), "--num-prompts", "6"]
    # a ring of 1.5 layers and nothing resident: every expert streams (a double buffer would hold them all)
    argv += ["--gen-len", "6", "--device-memory", str(device_budget(tiny_model, spec.num_experts * 3 // 2))]
    argv += ["--experts-placement", "gpu", "--link-bandwidth", "10MB/s", "--skip-references", "--skip-transformers"]
    r = subprocess.run([*argv, "--json-out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["link_bandwidth"] == 10e6 and res["ours"]["policy"]["experts"] == "gpu"
    assert res["ours"]["resident_experts"] == 0 and res["ours"]["expert_bytes_per_step"] > 0
    errors = res["hrm_layer_error"]
    assert set(errors) == {"ours", "overlap_off"}
    # ours hides the tiny compute behind the link; (b) adds it, and the tiny model's compute is mostly
    # per-call overhead the roofline does not see, so only its lower side is checked
    assert -0.05 < errors["ours"] < 0.5 and errors["overlap_off"] > -0.05, errors
    copy = res["stages_per_layer"]["expert copy (exposed wait)"]
    link = spec.num_experts * 3 * 64 * 128 * 4 / 10e6  # a layer's pages over the link (+ the memcpy's share)
    assert link <= copy["predicted"] < 1.1 * link
    assert res["ratios"]["(b) overlap off"] > 0 and res["ratios"]["(b) overlap off, decode"] > 1.0
    # (d): the paper's alternating steps at the same placement and micro-batch, named in the ratios
    assert res["alternating"]["generated_tokens_per_second"] > 0 and res["ratios"]["(d) alternating steps"] > 0
    assert "(d) alternating steps" in r.stdout
    assert "HRM layer time, measured / predicted - 1: ours" in r.stdout and "behind a simulated" in r.stdout
