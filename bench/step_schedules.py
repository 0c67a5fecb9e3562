"""Mixed steps against the alternating schedule, and a layer's experts once per group of micro-batches
against once per micro-batch, in one run (docs/cgopipe-and-benchmarks.md): the same job through three
stacks behind the same simulated link, every expert streamed, with continuous admission (sequences
sampled with a seed per row and cut by stop strings, so they end at lengths no scheduler knows in
advance and newcomers arrive every few steps). Per run: weight passes (steps) and device expert passes
(layer FFN passes over a layer) per generated token, the mean decode batch, end-to-end generated tokens
per second and the HRM's prediction of it (the orchestrator's, at the batch in force), with ratios
against the alternating run of this same invocation.

    python bench/step_schedules.py [--rows 1024] [--mtbench] [--link-bandwidth 20MB/s] [--max-batch-size 64]
        [--micro-batch-size 8] [--json-out F]

The tiny demo model (built in a temporary directory), with a device budget of its dense weights and 5
expert slots, so all 8 experts (0.4 MB a layer) cross the link at every pass: at 20 MB/s ~40 ms of
link against ~20 ms of compute, link-bound as a T4 is for Mixtral (docs/hrm.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench.stop_string_job import stop_string_job
from moe_lightning.benchmark import mtbench_lengths, scrape
from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.config.stack import StackConfig
from moe_lightning.config.units import parse_rate
from moe_lightning.demo_model import write_demo_model
from moe_lightning.launcher import Stack
from moe_lightning.spec import ModelSpec

from reference import device_budget

MAX_NEW = 64
STOPS = [".", "q", "!", "x", "j"]  # on the tiny demo model at temperature 1: ~30 tokens on average


RUNS = (("alternating", 0), ("mixed", 0), ("mixed", 2))  # (step schedule, expert groups); the first is the base


def run_name(schedule: str, groups: int) -> str:
    return f"{schedule}, experts " + (f"in {groups} groups" if groups else "per micro-batch")


def run_one(
    model: Path, schedule: str, groups: int, link: float, batch: int, mu: int, rows: list[Prompt], logs: Path
) -> dict:
    stack = Stack(
        StackConfig(
            model=model,
            port=0,
            run_id=f"sched{schedule}{groups}",
            kv_cache_memory="256MiB",
            # the dense weights and 5 slots: all 8 experts stream (link 0: the whole model resident, no link)
            device_memory=device_budget(model, ring=5) if link else None,
            link_bandwidth=link or None,
            experts_placement="gpu" if link else "auto",  # streamed: on a CPU "auto" may compute them in place
            max_batch_size=batch,  # far fewer than the rows: sequences finish, newcomers join every few steps
            micro_batch_size=mu,
            step_schedule=schedule,
            expert_groups=groups,
            log_dir=logs / f"{schedule}{groups}",
        )
    )
    stack.start(timeout=300)
    try:
        with GenerationClient(stack.api_address, timeout=3600) as c:
            t0 = time.perf_counter()
            done = c.batch_generate_all(rows, chunk_size=256)
            wall = time.perf_counter() - t0
        seen = scrape(stack.endpoints()["orchestrator"]["metrics"])
        passes = scrape(stack.endpoints()["gpu_expert"]["metrics"]).get("moe_lightning_expert_ffn_passes_total", 0.0)
    finally:
        stack.stop()
    tokens = sum(len(d.token_ids) for d in done)
    steps = {
        k: seen.get(f'moe_lightning_step_seconds_count{{kind="{k}"}}', 0.0) for k in ("prefill", "decode", "mixed")
    }
    decode_steps = seen.get("moe_lightning_decode_batch_size_count", 0.0)
    predicted = seen.get(f'moe_lightning_predicted_generated_tokens_per_second{{step_schedule="{schedule}"}}', 0.0)
    return {
        "run": run_name(schedule, groups),
        "step_schedule": schedule,
        "expert_groups": groups,
        "steps": {k: int(v) for k, v in steps.items()},
        "weight_passes_per_generated_token": sum(steps.values()) / tokens,
        "expert_passes_per_generated_token": passes / ModelSpec.from_pretrained(model).num_layers / tokens,
        "mean_decode_batch": seen.get("moe_lightning_decode_batch_size_sum", 0.0) / decode_steps if decode_steps else 0,
        "generated_tokens": tokens,
        "wall_s": wall,
        "tokens_per_second": tokens / wall,
        "predicted_tokens_per_second": predicted,
        "outputs": [d.token_ids for d in done],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument(
        "--mtbench", action="store_true", help="prompt lengths as MT-Bench's (mean 77, at most 418), not 9-72 tokens"
    )
    p.add_argument("--link-bandwidth", type=parse_rate, default=parse_rate("20MB/s"))
    p.add_argument("--resident", action="store_true", help="no link: the whole model on the device (CPU), unstreamed")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="step-schedules-") as tmp:
        model = write_demo_model(Path(tmp) / "tiny", "tiny", seed=0, progress=False)
        lengths = mtbench_lengths(args.rows) if args.mtbench else [9 + (i * 13) % 64 for i in range(args.rows)]
        rows = stop_string_job(args.rows, lambda i: lengths[i] - 1, MAX_NEW, STOPS)  # (a BOS before them)
        link = 0.0 if args.resident else args.link_bandwidth
        batch, mu = args.max_batch_size, args.micro_batch_size
        runs = [run_one(model, s, g, link, batch, mu, rows, Path(tmp)) for s, g in RUNS]
    base = runs[0]
    link_text = "none" if args.resident else f"{args.link_bandwidth / 1e6:.0f} MB/s"
    shape = "MT-Bench lengths" if args.mtbench else "prompts of 9-72 tokens"
    print(
        f"{args.rows} rows ({shape}), max_tokens {MAX_NEW}, stop {STOPS}, link {link_text}, "
        f"batch {batch} in micro-batches of {mu}"
    )
    print(
        f"{'run':<38}{'prefill':>8}{'decode':>8}{'mixed':>8}{'passes/tok':>11}{'FFN/tok':>9}{'batch':>7}"
        f"{'tok/s':>7}{'HRM':>7}{'x':>7}"
    )
    for r in runs:
        r["ratios"] = {"tokens_per_second_vs_alternating": r["tokens_per_second"] / base["tokens_per_second"]}
        st = r["steps"]
        print(
            f"{r['run']:<38}{st['prefill']:>8}{st['decode']:>8}{st['mixed']:>8}"
            f"{r['weight_passes_per_generated_token']:>11.4f}{r['expert_passes_per_generated_token']:>9.4f}"
            f"{r['mean_decode_batch']:>7.1f}{r['tokens_per_second']:>7.0f}{r['predicted_tokens_per_second']:>7.0f}"
            f"{r['ratios']['tokens_per_second_vs_alternating']:>6.2f}x"
        )
    same = all(r["outputs"] == base["outputs"] for r in runs)
    print(f"{base['generated_tokens']} tokens; outputs identical across runs: {same}")
    if args.json_out:
        summary = {"rows": args.rows, "link_bandwidth": args.link_bandwidth, "max_batch_size": batch}
        summary["micro_batch_size"], summary["mtbench_lengths"] = mu, args.mtbench
        summary["identical_outputs"] = same
        summary["runs"] = [{k: v for k, v in r.items() if k != "outputs"} for r in runs]
        args.json_out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
