"""KV by need against reservation, in one run (docs/kv-cache.md): the same job through stacks with the
same --kv-cache-memory, whose sequences end at lengths nobody knows in advance (sampled, seeded, cut
by stop strings) with max_tokens 256. For each of reserve / need (and need with an 8-bit cache):
the mean sequences decoded together, preemptions, and the job's generated tokens per second, with
ratios against the reservation run of this same invocation.

    python bench/kv_by_need.py [--rows 512] [--kv-sequences 48] [--kv-dtypes float32,int8] [--json-out F]

The KV cache is sized to hold --kv-sequences sequences at their full context (prompt + 256) in
float32: what reservation admits. The batch size is fixed far above it so that KV alone binds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.stop_string_job import stop_string_job
from moe_lightning.benchmark import scrape
from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.config.stack import StackConfig
from moe_lightning.demo_model import write_demo_model
from moe_lightning.kv_format import bytes_per_token
from moe_lightning.launcher import Stack
from moe_lightning.spec import ModelSpec

MAX_NEW = 256
STOPS = [".", "q", "!", "x"]  # on the tiny demo model at temperature 1: ~100 tokens on average, ~10% reach 256


def run_one(model: Path, admission: str, kv_dtype: str, kv_bytes: int, rows: list[Prompt], logs: Path) -> dict:
    config = StackConfig(
        model=model,
        port=0,
        run_id=f"kvneed{admission}{kv_dtype}",
        kv_cache_memory=kv_bytes,
        kv_dtype=kv_dtype,
        kv_admission=admission,
        max_batch_size=4096,
        log_dir=logs / f"{admission}-{kv_dtype}",
    )
    stack = Stack(config)
    stack.start(timeout=300)
    try:
        with GenerationClient(stack.api_address, timeout=1800) as c:
            meta = c.server_metadata()
            t0 = time.perf_counter()
            done = c.batch_generate_all(rows, chunk_size=256)
            wall = time.perf_counter() - t0
        seen = scrape(stack.endpoints()["orchestrator"]["metrics"])
    finally:
        stack.stop()
    tokens = sum(len(d.token_ids) for d in done)
    steps = seen.get("moe_lightning_decode_batch_size_count", 0.0)
    return {
        "kv_admission": admission,
        "kv_dtype": kv_dtype,
        "kv_cache_tokens": meta.kv_cache_tokens,
        "mean_sequences_in_flight": seen.get("moe_lightning_decode_batch_size_sum", 0.0) / steps if steps else 0.0,
        "decode_steps": int(steps),
        "preemptions": int(seen.get("moe_lightning_preemptions_total", 0.0)),
        "recomputed_tokens": int(seen.get("moe_lightning_recomputed_tokens_total", 0.0)),
        "generated_tokens": tokens,
        "mean_completion_tokens": tokens / len(done),
        "wall_s": wall,
        "tokens_per_second": tokens / wall,
        "outputs": [d.token_ids for d in done],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="default: the tiny demo model, built in a temporary directory")
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--kv-sequences", type=int, default=48, help="sequences the cache holds at full context (fp32)")
    p.add_argument("--kv-dtypes", default="float32,int8", help="the caches of the by-need runs")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kv-by-need-") as tmp:
        model = args.model or write_demo_model(Path(tmp) / "tiny", "tiny", seed=0, progress=False)
        spec = ModelSpec.from_pretrained(model)
        rows = stop_string_job(args.rows, lambda i: 8 + i % 24, MAX_NEW, STOPS)
        longest = statistics.mean(len(r.token_ids or ()) for r in rows) + MAX_NEW
        kv_bytes = int(args.kv_sequences * longest) * bytes_per_token(
            "float32", spec.num_layers, spec.num_kv_heads, spec.head_dim
        )
        runs = [run_one(model, "reserve", "float32", kv_bytes, rows, Path(tmp))]
        runs += [run_one(model, "need", d, kv_bytes, rows, Path(tmp)) for d in args.kv_dtypes.split(",")]
    base = runs[0]
    print(f"{args.rows} rows, max_tokens {MAX_NEW}, stop {STOPS}, --kv-cache-memory {kv_bytes} B on every run")
    print(
        f"{'admission':<10}{'kv':<9}{'kv tokens':>10}{'in flight':>11}{'preempt':>9}{'tok/s':>9}"
        f"{'x flight':>10}{'x tok/s':>9}"
    )
    for r in runs:
        r["ratios"] = {
            "in_flight_vs_reserve": r["mean_sequences_in_flight"] / base["mean_sequences_in_flight"],
            "tokens_per_second_vs_reserve": r["tokens_per_second"] / base["tokens_per_second"],
        }
        print(
            f"{r['kv_admission']:<10}{r['kv_dtype']:<9}{r['kv_cache_tokens']:>10}{r['mean_sequences_in_flight']:>11.1f}"
            f"{r['preemptions']:>9}{r['tokens_per_second']:>9.0f}{r['ratios']['in_flight_vs_reserve']:>9.2f}x"
            f"{r['ratios']['tokens_per_second_vs_reserve']:>8.2f}x"
        )
    same = all(r["outputs"] == base["outputs"] for r in runs if r["kv_dtype"] == base["kv_dtype"])
    print(f"mean completion {base['mean_completion_tokens']:.1f} tokens; float32 outputs identical across runs: {same}")
    if args.json_out:
        summary = {"rows": args.rows, "kv_cache_memory": kv_bytes, "identical_outputs": same}
        summary["runs"] = [{k: v for k, v in r.items() if k != "outputs"} for r in runs]
        args.json_out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
