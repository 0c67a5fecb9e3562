"""`moe-lightning run --ray` on a real local Ray cluster of two nodes (a head and a second node,
each its own raylet with its own resources: two "boxes"), each node's actor starting a tiny-model
stack: 2,000 prompts in a directory of two files, read and split by Ray Data, give the same rows as
a single-box `run`; a stack killed mid-job, then the second node removed (its raylet, actor, stack
and objects), still give every row once (their parts go elsewhere); a re-run resumes, doing only
the parts that are missing, and refuses to resume a job split otherwise (docs/cluster.md). Ray's
start-up is paid once for the module."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": a Ray cluster of this machine only, on loopback
os.environ[LOOPBACK_ONLY] = "0"  # before Ray is imported: it reads it then
ray = pytest.importorskip("ray", reason="the ray extra is not installed")

from ray.cluster_utils import Cluster  # noqa: E402

from moe_lightning.cluster.parts import check_plan  # noqa: E402
from moe_lightning.shm.segment import sweep_stale  # noqa: E402

from processes import cli  # noqa: E402

ROWS = 2000
TOKENS = 4


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Both nodes and every driver on 127.0.0.1: Ray resolves a loopback address to the machine's
    own unless it runs as a one-machine cluster (a driver started on 127.0.0.1 otherwise looks for
    the head at the machine's address and waits forever): LOOPBACK_ONLY, set before Ray is imported
    (Ray reads it then) and inherited by the nodes, the drivers and their workers."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    assert c.address.startswith("127.0.0.1:")
    yield c  # the last test takes its second node away
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
    assert [got[k] for k in range(ROWS)] == reference  # row for row (greedy): a.jsonl's rows, then b.parquet's


def test_a_stack_killed_then_a_node_lost_mid_job_loses_no_row_and_a_rerun_resumes(
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
    written = len(list(out.glob("part-*.parquet")))
    while len(list(out.glob("part-*.parquet"))) < written + 3:  # going on; then the second box goes away
        assert job.poll() is None and time.monotonic() < deadline, job.stderr.read() if job.stderr else ""
        time.sleep(0.2)
    (worker,) = cluster.worker_nodes
    cluster.remove_node(worker)  # its raylet, its actor, the stack that actor started, its objects
    _, err = job.communicate(timeout=600)
    assert job.returncode == 0, err[-3000:]
    assert "failed (attempt 1)" in err  # their parts were given out again
    assert len(output_rows(out)) == ROWS  # ... and every row is there once
    left = subprocess.run(["pgrep", "-f", f"services.*--run-id rk{os.getpid()}-n"], capture_output=True, text=True)
    assert not left.stdout.split(), "a service of the lost node's stack outlived it"
    for node in ("n0", "n1"):  # what the SIGKILLed service had mapped: its box is gone, ours stays
        sweep_stale(f"rk{os.getpid()}-{node}")
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


def test_a_resume_split_otherwise_is_refused_before_it_writes(tmp_path: Path) -> None:
    fs = pafs.LocalFileSystem()
    check_plan(fs, str(tmp_path), 100, ROWS)  # the first run records its split
    check_plan(fs, str(tmp_path), 100, ROWS)  # the same split: a resume
    for rows, part_rows in ((ROWS, 150), (ROWS + 1, 100)):  # parts would overlap the ones there
        with pytest.raises(ValueError, match="use the same input and --part-rows to resume"):
            check_plan(fs, str(tmp_path), part_rows, rows)


def test_a_cuda_job_runs_stacks_only_on_nodes_with_its_gpus() -> None:
    import argparse

    from moe_lightning.cluster.driver import job_nodes

    head = {"NodeID": "h", "Alive": True, "Resources": {"CPU": 2.0}}  # a KubeRay head pod: no GPU
    box = {"NodeID": "b", "Alive": True, "Resources": {"CPU": 16.0, "GPU": 2.0}}
    dead = {"NodeID": "d", "Alive": False, "Resources": {"GPU": 2.0}}
    cuda = argparse.Namespace(addr=None, device="cuda", gpus=2)
    assert job_nodes([head, box, dead], cuda) == [box]
    assert job_nodes([head, box, dead], argparse.Namespace(addr=None, device="cpu", gpus=1)) == [head, box]
    with pytest.raises(RuntimeError, match="no alive Ray node has the 4 GPU"):
        job_nodes([head, box], argparse.Namespace(addr=None, device="cuda", gpus=4))
