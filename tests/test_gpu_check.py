"""bench/gpu_check.py, the H200 check, kept runnable: its whole flow (the GPU unit tests, the preflight
through the paths a first GPU run breaks, build, ours vs (b) through `moe-lightning bench`, the
transformers-offload baseline, the report) on the toy model on the CPU (--dry-run). The speeds mean
nothing here; that every phase runs and reports does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_dry_run_runs_every_phase_and_writes_the_report(tmp_path: Path) -> None:
    report_path = tmp_path / "out" / "gpu_check.json"
    r = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--dry-run", "--json", str(report_path), "--work-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["status"] == "ok" and report["dry_run"]
    assert {name: p["ok"] for name, p in report["phases"].items()} == {
        "cuda-tests": True,  # the CPU cases of the same files run; the CUDA ones skip
        "build-preflight": True,
        "preflight-float32": True,
        "preflight-device-attention-float32": True,
        "preflight-formats-float32": True,
        "preflight-tensor-parallel-float32": True,
        "build-toy": True,
        "ours": True,
        "offload": True,
        "formats": True,
    }
    runs = report["preflight-formats-float32"]  # the expert formats, experts streamed ("formats" in a
    assert set(runs) == {"none", "int8", "int4", "int4_over_none"}  # dry run: the same flow, skipped)
    assert runs["int4"]["expert_bytes_per_step"] < runs["int8"]["expert_bytes_per_step"]
    assert runs["int8"]["expert_bytes_per_step"] < runs["none"]["expert_bytes_per_step"]
    assert runs["int4_over_none"]["target"] == 2.0
    assert report["phases"]["formats"]["skipped"].startswith("dry run")
    ranks = report["preflight-tensor-parallel-float32"]  # 2 ranks on the one device, gloo
    assert [r["rank"] for r in ranks["per_rank"]["ranks"]] == [0, 1] and ranks["decode_tokens_per_second"] > 0
    preflight = json.loads((tmp_path / "out" / "gpu_check-preflight-float32.json").read_text())
    assert preflight["ours"] and "overlap_off" not in preflight  # --skip-overlap-off: (b) runs in `ours`
    two_ranks = json.loads((tmp_path / "out" / "gpu_check-preflight-tensor-parallel-float32.json").read_text())
    assert two_ranks["ours"] and "overlap_off" not in two_ranks  # the phase files ours only
    pipeline = report["preflight"]["preflight-float32"]
    assert pipeline["micro_batches"] == 8 and pipeline["residency_changes"] >= 1
    assert pipeline["cuda_syncs_per_decode_step"] is None  # counted on CUDA only
    assert report["preflight"]["preflight-device-attention-float32"]["policy"]["attention"] == "gpu"
    assert report["environment"]["import_errors"] == []
    budget = report["budget"]["ours"]
    assert budget["resident_experts"] >= 0.2 * budget["total_experts"]  # the budget rule: at least 20 %
    assert report["ours_bench"]["ours"]["generated_tokens_per_second"] > 0
    assert report["ours_bench"]["overlap_off"]["generated_tokens_per_second"] > 0
    assert report["offload"]["same_prompts"] and report["offload"]["generated_tokens"] == 4 * 4
    assert set(report["ratios"]) == {"ours_over_overlap_off", "ours_over_offload"}
    assert "ours / overlap_off" in r.stderr and (tmp_path / "out" / "gpu_check-logs").is_dir()
