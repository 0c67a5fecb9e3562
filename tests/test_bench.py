"""The benchmark command on the tiny model: it runs every configuration and reports ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


LINK = "2.5MB/s"  # a layer's pages in ~160 ms, where the tiny model computes one in ~10-30: link-bound


def _link_bench(model: Path, out: Path, schedule: str, *extra: str) -> tuple[dict, str]:
    """`bench --link-bandwidth`: every stack streams its experts over the simulated link (a ring of 1.5
    layers, nothing resident: a double buffer would hold them all); 48 prompts, 16 tokens each."""
    spec = ModelSpec.from_pretrained(model)
    argv = [sys.executable, "-m", "moe_lightning.cli", "bench", "--model", str(model), "--num-prompts", "48"]
    argv += ["--gen-len", "16", "--device-memory", str(device_budget(model, spec.num_experts * 3 // 2))]
    argv += ["--experts-placement", "gpu", "--link-bandwidth", LINK, "--skip-references", "--skip-transformers"]
    argv += ["--step-schedule", schedule, *extra, "--json-out", str(out)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text()), r.stdout


def test_bench_behind_a_simulated_link_reports_decode_and_the_hrms_layer_error_whatever_the_schedule(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Link-bound (the tiny model computes a layer in 10-30 ms, its link takes ~160), so both predictions
    are about the link's time: the error only measures what the simulation and the schedule add. With
    short generations most decodes happen inside mixed steps (admission takes steps under the HRM's
    prefill budget): decode tokens/s counts them at their decode share (hrm/decode_share.py), so the
    decode ratio to (b) and the HRM's layer error (predicted at the batch each run decoded) agree with
    the same run at alternating steps, where every decode step is pure (issue 53: 1.02x against 1.71x,
    and 36-39 % off, before). Where compute is a large part of a step (a faster link), the two schedules
    decode at different batches and their (b)s differ for real (docs/cgopipe-and-benchmarks.md)."""
    spec = ModelSpec.from_pretrained(tiny_model)
    # admission in ~30 steps of 128 prompt tokens whatever this machine's calibration makes of the budget
    mixed, stdout = _link_bench(tiny_model, tmp_path / "mixed.json", "mixed", "--prefill-budget", "128")
    alternating, _ = _link_bench(tiny_model, tmp_path / "alt.json", "alternating", "--skip-alternating")
    assert mixed["link_bandwidth"] == 2.5e6 and mixed["ours"]["policy"]["experts"] == "gpu"
    assert mixed["ours"]["resident_experts"] == 0 and mixed["ours"]["expert_bytes_per_step"] > 0
    errors = mixed["hrm_layer_error"]
    assert set(errors) == {"ours", "overlap_off", "alternating"}
    # ours hides the tiny compute behind the link; (b) adds it, and the tiny model's compute is mostly
    # per-call overhead the roofline does not see, so only its lower side is checked
    assert -0.05 < errors["ours"] < 0.5 and errors["overlap_off"] > -0.05, errors
    copy = mixed["stages_per_layer"]["expert copy (exposed wait)"]
    link = spec.num_experts * 3 * 64 * 128 * 4 / 2.5e6  # a layer's pages over the link (+ the memcpy's share)
    assert link <= copy["predicted"] < 1.1 * link
    # decode is decode: every decode row of the run, over the time charged to decoding in every step kind
    for run in ("ours", "overlap_off"):
        steps, decode = mixed[run]["steps"], mixed[run]["decode"]
        assert steps["mixed"] >= 3 and decode["by_kind"]["mixed"]["tokens"] > decode["by_kind"]["decode"]["tokens"]
        # 15 decodes a sequence; a prompt whose chunk stopped one token short of its end feeds that token
        # in a decode micro-batch (the batcher's `decoding`), a row like a decode's
        assert 48 * 15 <= decode["tokens"] < 48 * 16
        # what the steps that decoded took bounds it: pure decode steps' time alone overstated it ~3x
        stepped = decode["by_kind"]["decode"]["seconds"] + decode["by_kind"]["mixed"]["seconds"]
        assert mixed[run]["decode_tokens_per_second"] == pytest.approx(decode["tokens"] / stepped)
        assert 0.9 < decode["by_kind"]["mixed"]["share"] <= 1.0  # link-bound: the prompt tokens rode free
    assert alternating["ours"]["steps"]["mixed"] == 0
    ratio = {r["ratios"]["(b) overlap off, decode"] for r in (mixed, alternating)}
    assert max(ratio) / min(ratio) < 1.2, ratio  # 1.07 and 1.17 on the dev VM
    assert abs(mixed["hrm_layer_error"]["ours"] - alternating["hrm_layer_error"]["ours"]) < 0.05
    # (b)'s compute shows: the tiny model's is per-call cost the roofline does not see, which smaller
    # decode batches (the mixed run's, ~17 rows a step against 48) do not shrink as predicted
    assert abs(mixed["hrm_layer_error"]["overlap_off"] - alternating["hrm_layer_error"]["overlap_off"]) < 0.15
    # (d): the paper's alternating steps at the same placement and micro-batch, named in the ratios
    assert mixed["alternating"]["generated_tokens_per_second"] > 0 and mixed["ratios"]["(d) alternating steps"] > 0
    assert "(d) alternating steps" in stdout and "(d) alternating steps, decode" in stdout
    assert "HRM layer time, measured / predicted - 1: ours" in stdout and "behind a simulated" in stdout


def test_bench_runs_thousands_of_prompts_past_the_apis_per_call_limit(tiny_model: Path, tmp_path: Path) -> None:
    """The paper's operating point is thousands of sequences; one BatchGenerate takes at most 1,024, so
    bench feeds the API in calls of that size, all in flight at once (the whole set is the batch)."""
    out = tmp_path / "many.json"
    argv = [sys.executable, "-m", "moe_lightning.cli", "bench", "--model", str(tiny_model), "--num-prompts", "4096"]
    argv += ["--gen-len", "2", "--skip-references", "--skip-transformers", "--skip-alternating", "--skip-overlap-off"]
    r = subprocess.run([*argv, "--json-out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ours = json.loads(out.read_text())["ours"]
    assert ours["in_force"]["batch"] == 4096 and ours["decode"]["tokens"] >= 4096
    assert ours["generated_tokens_per_second"] > 0 and ours["decode_tokens_per_second"] > 0
