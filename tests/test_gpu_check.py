"""bench/gpu_check.py, the H200 check, kept runnable and within its lease (issue 26): its whole flow
(the HRM's pick and prediction, the toy preflight, ours vs (b) through `moe-lightning bench`, the
transformers-offload baseline, then the optional phases: the GPU unit tests, the expert formats, two
tensor-parallel ranks, attention on the device) on the toy model on the CPU (--dry-run), and what
the device tool brings back of its output folder. The speeds mean nothing here; that every phase
runs and reports, in that order, within the limits, does."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.gpucheck.optional import OptionalPhase, run_optional  # noqa: E402
from bench.gpucheck.outputs import ARCHIVE_NAME, MAX_DEPTH, MAX_FILES, REPORT_NAME, out_dir_problems  # noqa: E402

MAIN = ("hrm", "build-toy", "preflight-float32", "ours", "offload")
OPTIONAL = ("cuda-tests", "formats", "tensor-parallel", "device-attention")


def test_dry_run_runs_every_phase_within_the_lease_limits(tmp_path: Path) -> None:
    out = tmp_path / "out"
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(out), "--work-dir", str(tmp_path / "work")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    # what comes back from $OUT: one report, one archive, nothing too deep or oddly named
    assert sorted(p.name for p in out.rglob("*")) == sorted([REPORT_NAME, ARCHIVE_NAME])
    assert out_dir_problems(out) == []
    report = json.loads((out / REPORT_NAME).read_text())
    assert report["status"] == "ok" and report["dry_run"]
    limits = report["limits"]
    assert limits == {
        "script_seconds": 360,
        "first_measurement_seconds": 180,
        "deadline_seconds": 300.0,
        "out_files": MAX_FILES,
        "out_depth": MAX_DEPTH,
    }
    assert report["elapsed_seconds"] <= limits["deadline_seconds"] and wall <= limits["deadline_seconds"] + 30
    assert report["outputs"]["problems"] == [] and report["outputs"]["archive"]["left_out"] == []

    # every phase ran, the main comparison before the optional ones, its summary printed in between
    phases = report["phases"]
    assert {name: p["ok"] for name, p in phases.items()} == dict.fromkeys((*MAIN, *OPTIONAL), True)
    assert max(list(phases).index(n) for n in MAIN) < min(list(phases).index(n) for n in OPTIONAL)
    first_summary = r.stderr.index("summary of the main comparison")
    assert first_summary < r.stderr.index("cuda-tests: started") < r.stderr.rindex("] summary (also in")
    assert report["summary"] and "ours / overlap_off" in r.stderr

    # the HRM's pick is what ran, in the configuration its prediction is of (the GPU run's: alternating
    # steps, its micro-batch, expert groups and prefill budget), at a size where admission takes steps
    hrm = report["hrm"]
    assert 1 <= hrm["batch"] <= hrm["batch_cap"] == 256 and hrm["table"]
    assert hrm["profile"] == "h200" and "no GPU" in hrm["profile_chosen"]  # auto: the GPU's name picks it
    assert report["workload"]["prompts"] == hrm["batch"]
    bench = report["ours_bench"]
    ours, off = bench["ours"], bench["overlap_off"]
    assert ours["micro_batches"] == hrm["micro_batches"] and ours["generated_tokens_per_second"] > 0
    assert off["generated_tokens_per_second"] > 0
    assert hrm["config"]["step_schedule"] == "alternating"
    for run in (ours, off):
        assert {k: run["in_force"][k] for k in hrm["config"]} == hrm["config"]
        assert run["steps"]["prefill"] >= 3 and run["steps"]["mixed"] == 0  # admission took several steps
        assert run["steps"]["decode"] == 3 and run["decode"]["by_kind"]["decode"]["tokens"] == hrm["batch"] * 3
    pvm = report["predicted_vs_measured"]
    assert pvm["configuration"]["same"] is True
    assert pvm["ours_decode_tokens_per_second"]["predicted"] == hrm["ours"]["decode_tokens_per_second"]
    assert pvm["ours_decode_tokens_per_second"]["measured"] == ours["decode_tokens_per_second"]
    assert pvm["ours_over_overlap_off_decode"]["predicted"] == hrm["ratios"]["ours_over_overlap_off"]
    # decode against decode (the targets' and the HRM's), end to end beside it
    ratios = report["ratios"]
    assert set(ratios) == {"ours_over_overlap_off", "ours_over_offload"}
    assert {r["target"] for r in ratios.values()} == {3.0, 10.0}
    b = ratios["ours_over_overlap_off"]
    assert b["value"] == ours["decode_tokens_per_second"] / off["decode_tokens_per_second"]
    assert b["end_to_end"] == ours["generated_tokens_per_second"] / off["generated_tokens_per_second"]
    # bench's JSON was written after each run, not only at the end: ours' numbers arrived before (b) ran
    saved = phases["ours"]["runs_saved"]
    assert list(saved) == ["ours", "overlap_off"] and saved["ours"] < saved["overlap_off"], saved
    assert saved["ours"] <= limits["first_measurement_seconds"] and "ours' numbers saved" in r.stderr

    offload = report["offload"]
    assert offload["same_prompts"] and offload["prompts_run"] == hrm["batch"]
    assert offload["generated_tokens"] == hrm["batch"] * 4 and offload["decode_tokens_per_second"] > 0
    assert offload["start_batch"] == min(hrm["batch"], 2 * hrm["offload"]["batch"])
    assert (
        ratios["ours_over_offload"]["value"] == ours["decode_tokens_per_second"] / offload["decode_tokens_per_second"]
    )

    # the optional phases' numbers
    runs = report["formats"]  # experts streamed, each format at a quarter of its own pages
    assert set(runs) == {"none", "int4", "int4_over_none"} and runs["int4_over_none"]["target"] == 2.0
    assert runs["int4"]["expert_bytes_per_step"] < runs["none"]["expert_bytes_per_step"]
    ranks = report["tensor-parallel"]  # 2 ranks on the one device, gloo
    assert [r["rank"] for r in ranks["per_rank"]["ranks"]] == [0, 1] and ranks["decode_tokens_per_second"] > 0
    pipeline = report["preflight"]["preflight-float32"]
    assert pipeline["micro_batches"] == 8 and pipeline["residency_changes"] >= 1
    assert pipeline["host_syncs_per_decode_step"] > 0  # on a CPU, the reads that would be syncs on CUDA
    assert report["device-attention"]["policy"]["attention"] == "gpu"
    assert report["environment"]["import_errors"] == []
    budget = report["budget"]["ours"]
    assert budget["resident_experts"] >= 0.2 * budget["total_experts"]  # the budget rule: at least 20 %

    # the archive: log tails (phases and services), the bench JSONs, our Chrome trace
    with tarfile.open(out / ARCHIVE_NAME) as tar:
        names = set(tar.getnames())
    assert {"gpu_check-logs/ours-trace.json", "gpu_check-logs/ours.json", "gpu_check-logs/logs/ours.log"} <= names
    assert any(n.startswith("gpu_check-logs/logs/ours-overlap-gpu_expert") for n in names)
    preflight = json.loads(_member(out / ARCHIVE_NAME, "gpu_check-logs/preflight-float32.json"))
    assert preflight["ours"] and "overlap_off" not in preflight  # --skip-overlap-off: (b) runs in `ours`


def _member(archive: Path, name: str) -> str:
    with tarfile.open(archive) as tar:
        f = tar.extractfile(name)
        assert f is not None
        return f.read().decode()


class _Check:
    def __init__(self, left: float) -> None:
        self._left = left
        self.phases: dict[str, dict[str, Any]] = {}

    def left(self) -> float:
        return self._left

    def record(self, name: str, **fields: Any) -> None:
        self.phases.setdefault(name, {}).update(fields)


def test_optional_phases_are_skipped_when_time_runs_short_and_a_failure_stops_none() -> None:
    check, ran = _Check(left=100.0), []

    def run(name: str) -> Any:
        def go(timeout: float) -> None:
            ran.append((name, timeout))
            if name == "broken":
                raise RuntimeError("no GPU today")
            check._left -= 50

        return go

    plan = [("broken", 10, 20), ("a", 30, 60), ("b", 30, 60), ("c", 10, 60), ("d", 1, 9)]  # name, needs, cap
    phases = [OptionalPhase(n, needs, cap, run(n)) for n, needs, cap in plan]
    run_optional(check, phases, skip={"d"})
    # 10 s are kept for the report: broken raises (recorded); a gets its cap; b the 40 s left; c none
    assert ran == [("broken", 20), ("a", 60), ("b", 40)]
    assert check.phases["broken"]["ok"] is False and "no GPU today" in check.phases["broken"]["error"]
    assert check.phases["c"] == {"ok": None, "skipped": "0 s left before the deadline, it needs 10 s"}
    assert check.phases["d"] == {"ok": None, "skipped": "--skip"}


def test_out_dir_problems_names_what_would_not_come_back(tmp_path: Path) -> None:
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "b" / "ok.json").write_text("{}")  # two folders down: comes back
    (tmp_path / "a" / "b" / "c" / "deep.log").write_text("x")
    (tmp_path / "bad name.txt").write_text("x")
    for i in range(7):
        (tmp_path / f"f{i}.log").write_text("x")
    problems = out_dir_problems(tmp_path)
    assert any(p.startswith("10 files") for p in problems)
    assert any("deep.log: 3 folders deep" in p for p in problems)
    assert any(p.startswith("bad name.txt") for p in problems)
    assert not any("ok.json" in p for p in problems)


def test_an_interruption_writes_the_report_and_the_archive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.gpu_check as gpu_check

    def interrupted(self: gpu_check.GpuCheck) -> int:
        self.record("ours", ok=None, command="moe-lightning bench ...")
        (self.logs / "ours.log").write_text("ours (overlap on)...\n")
        raise KeyboardInterrupt

    monkeypatch.setattr(gpu_check.GpuCheck, "run", interrupted)
    out = tmp_path / "out"
    assert gpu_check.main(["--dry-run", "--out", str(out), "--work-dir", str(tmp_path / "work")]) == 130
    report = json.loads((out / REPORT_NAME).read_text())
    assert report["status"] == "interrupted" and report["phases"]["ours"]["command"]
    assert _member(out / ARCHIVE_NAME, "gpu_check-logs/logs/ours.log") == "ours (overlap on)...\n"
    assert out_dir_problems(out) == []


def test_predict_only_prints_the_hrm_pick_for_the_check_without_a_gpu() -> None:
    r = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--predict-only"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "HRM pick on h200: N=1024 in 32 micro-batches of 32" in r.stdout  # docs/cgopipe-and-benchmarks.md
    assert "binds: link" in r.stdout and "ours / (b) = " in r.stdout and "ours / offload >= " in r.stdout
    assert "runs as: alternating steps" in r.stdout


def test_the_prediction_is_made_on_the_preset_of_the_gpu_it_runs_on() -> None:
    """A plain lease is an H100, one asked for an H200: each gets its own preset's prediction."""
    from bench.gpucheck.predict import profile_for

    assert profile_for("auto", "NVIDIA H100 80GB HBM3")[0].name == "h100"
    assert profile_for("auto", "NVIDIA H200")[0].name == "h200"
    assert profile_for("auto", None)[0].name == "h200" and "no GPU" in profile_for("auto", None)[1]
    assert profile_for("h100", "NVIDIA H200")[0].name == "h100"  # given wins


def test_a_layer_an_out_of_memory_pass_stranded_is_sent_back() -> None:
    """accelerate copies an offloaded module's weights in before its forward and drops them after; a pass
    that ran out of memory never ran the after, so that layer stayed on the GPU and the smaller retries
    failed too. The baseline sends such weights back before retrying (here on the CPU: the same hooks)."""
    import torch
    from accelerate import cpu_offload

    from bench.gpucheck.offload import _restore_offloaded

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x = torch.randn(3, 8)
    want = model(x)
    cpu_offload(model, execution_device=torch.device("cpu"))
    first = model[0]
    assert first.weight.device.type == "meta"  # offloaded between passes
    first._hf_hook.pre_forward(first, x)  # a pass began: the layer's weights copied in...
    assert first.weight.device.type == "cpu"  # ... and, the pass failing there, never dropped
    assert _restore_offloaded(model) == 1
    assert first.weight.device.type == "meta" and _restore_offloaded(model) == 0
    torch.testing.assert_close(model(x), want)  # the next pass copies it in again, as before
