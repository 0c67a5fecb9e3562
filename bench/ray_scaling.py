"""`run --ray` at 1 and 2 nodes of a local Ray cluster on the tiny demo model (docs/cluster.md,
"Scaling"): rows, tokens/s per node and in total, and the driver's own CPU time per row (splitting,
dispatch, the final check), which is what would stop scaling first past many boxes.

    python bench/ray_scaling.py [--rows 2000] [--tokens 8] [--json OUT]

On a 2-core machine both nodes share the cores: the numbers show the job's overheads, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def job(address: str, model: Path, src: Path, out: Path, tokens: int) -> dict:
    argv = [sys.executable, "-m", "moe_lightning.cli", "run", "--ray", address, "--model", str(model)]
    argv += ["--input", str(src), "--output", str(out), "--max-new-tokens", str(tokens), "--ignore-eos"]
    argv += ["--kv-cache-memory", "256MiB", "--no-progress", "--part-rows", "250"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    summary = json.loads((out / "_job.json").read_text())
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {**summary, "driver_cpu_seconds": cpu, "driver_wall_seconds": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from ray.cluster_utils import Cluster

    from moe_lightning.demo_model import write_demo_model

    work = Path(tempfile.mkdtemp(prefix="moe-lightning-ray-bench-"))
    model = write_demo_model(work / "tiny", "tiny", seed=0, progress=False)
    src = work / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"prompt {i} is about {i % 17}"}) + "\n" for i in range(args.rows)))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    results = {}
    try:
        for nodes in (1, 2):
            if nodes == 2:
                cluster.add_node(num_cpus=1)
                cluster.wait_for_nodes()
            results[nodes] = job(cluster.address, model, src, work / f"out{nodes}", args.tokens)
    finally:
        cluster.shutdown()
    print(f"{args.rows} rows x {args.tokens} tokens, tiny model, local Ray cluster (2 cores shared)")
    print(f"{'nodes':>5} {'wall s':>8} {'tok/s':>8} {'per node tok/s':>24} {'driver CPU ms/row':>18}")
    for n, r in results.items():
        per = ", ".join(f"{v['generated_tokens_per_second']:.0f}" for v in r["per_node"].values())
        ms = 1e3 * r["driver_cpu_seconds"] / r["rows"]
        print(f"{n:>5} {r['wall_seconds']:8.1f} {r['generated_tokens_per_second']:8.1f} {per:>24} {ms:18.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
