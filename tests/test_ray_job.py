"""`moe-lightning run --ray` on a real local Ray cluster of two nodes (a head and a second node,
each its own raylet with its own resources: two "boxes"), each node's actor starting a tiny-model
stack: 2,000 prompts in a directory of two files give the same rows as a single-box `run`; a stack
killed mid-job still gives every row once (its parts go elsewhere); a re-run resumes, doing only
the parts that are missing (docs/cluster.md). Ray's start-up is paid once for the module."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

from ray.cluster_utils import Cluster  # noqa: E402

from processes import cli  # noqa: E402

ROWS = 2000
TOKENS = 4


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same prompts as a directory of two files (JSONL + Parquet) and as one file."""
    import pyarrow as pa

    d = tmp_path_factory.mktemp("ray-input")
    rows = [f"prompt {i} is about {i % 17}" for i in range(ROWS)]
    (d / "parts").mkdir()
    (d / "parts" / "a.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows[:1200]))
    pq.write_table(pa.table({"prompt": rows[1200:]}), d / "parts" / "b.parquet")
    (d / "all.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    return d / "parts", d / "all.jsonl"


def ray_run(cluster: Cluster, model: Path, src: Path, out: Path, *extra: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "moe_lightning.cli", "run", "--ray", cluster.address, "--model", str(model)]
    argv += ["--input", str(src), "--output", str(out), "--max-new-tokens", str(TOKENS), "--ignore-eos"]
    argv += ["--kv-cache-memory", "64MiB", "--no-progress", "--part-rows", "100", *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def output_rows(out: Path) -> dict[str, str]:
    table = pq.read_table(out, columns=["row_key", "text"])
    keys, texts = table.column("row_key").to_pylist(), table.column("text").to_pylist()
    assert len(keys) == len(set(keys))  # nothing twice
    return dict(zip(keys, texts, strict=True))


def test_two_nodes_give_the_single_box_rows(
    cluster: Cluster, prompts: tuple[Path, Path], tiny_model: Path, tmp_path: Path
) -> None:
    parts, whole = prompts
    job = ray_run(cluster, tiny_model, parts, tmp_path / "out")
    _, err = job.communicate(timeout=600)
    assert job.returncode == 0, err[-3000:]
    summary = json.loads((tmp_path / "out" / "_job.json").read_text())
    assert summary["rows"] == ROWS and summary["nodes"] == 2 and len(summary["per_node"]) == 2
    assert all(n["rows"] > 0 for n in summary["per_node"].values())  # both boxes worked
    assert summary["completion_tokens"] == ROWS * TOKENS
    single = tmp_path / "single.parquet"
    r = cli(
        "run",
        "--model",
        str(tiny_model),
        "--input",
        str(whole),
        "--output",
        str(single),
        "--max-new-tokens",
        str(TOKENS),
        "--ignore-eos",
        "--no-progress",
        "--kv-cache-memory",
        "64MiB",
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    reference = pq.read_table(single, columns=["text"]).column("text").to_pylist()
    got = output_rows(tmp_path / "out")
    keys = [f"0:{i}" for i in range(1200)] + [f"1:{i}" for i in range(ROWS - 1200)]  # a.jsonl, then b.parquet
    assert [got[k] for k in keys] == reference  # row for row (greedy)


def test_a_stack_killed_mid_job_loses_no_row_and_a_rerun_resumes(
    cluster: Cluster, prompts: tuple[Path, Path], tiny_model: Path, tmp_path: Path
) -> None:
    parts, _ = prompts
    out = tmp_path / "out"
    job = ray_run(cluster, tiny_model, parts, out, "--run-id", f"rk{os.getpid()}")
    deadline = time.monotonic() + 300
    while len(list(out.glob("part-*.parquet"))) < 3:  # mid-job: some parts written, most not
        assert job.poll() is None and time.monotonic() < deadline, job.stderr.read() if job.stderr else ""
        time.sleep(0.2)
    victim = subprocess.run(
        ["pgrep", "-f", f"services.gpu_expert.*--run-id rk{os.getpid()}-n1"], capture_output=True, text=True
    )
    pids = [int(p) for p in victim.stdout.split()]
    assert pids, "node 1's gpu_expert is not running"
    os.kill(pids[0], signal.SIGKILL)
    _, err = job.communicate(timeout=600)
    assert job.returncode == 0, err[-3000:]
    assert "failed (attempt 1)" in err  # its parts were given out again
    assert len(output_rows(out)) == ROWS  # ... and every row is there once
    # resume: two parts gone from the output; a re-run does those two only
    removed = sorted(out.glob("part-*.parquet"))[5:7]
    for p in removed:
        p.unlink()
    again = ray_run(cluster, tiny_model, parts, out)
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-3000:]
    summary = json.loads((out / "_job.json").read_text())
    assert summary["rows_this_run"] == 200 and summary["rows"] == ROWS
    assert f"{len(list(out.glob('part-*.parquet'))) - 2} already in" in err
    assert len(output_rows(out)) == ROWS
