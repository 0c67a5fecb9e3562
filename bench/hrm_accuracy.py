"""How well the HRM predicts this machine: predicted vs measured decode time per stage and tokens/s.

Calibrates the roofs with our own kernels (cached per machine; --refresh re-measures), runs one
batch through the four-service stack, and compares, per layer of a decode step and at the policy
that ran (the orchestrator's), the cost model's stages with the decode steps' timings: the rows of
moe_lightning/hrm/stage_accuracy.py, the same ones `bench` prints and the planner's drift check reads.
Also prints what the optimizer would pick here. The error is a number we track; the target
is within 25 %.

    python bench/hrm_accuracy.py [--model models/demo-bench] [--batch 16] [--prompt-len 64] [--gen 32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from moe_lightning.benchmark import decode_totals, policy_that_ran, random_prompts, run_batch
from moe_lightning.demo_model import write_demo_model
from moe_lightning.hrm import stage_accuracy
from moe_lightning.hrm.calibrate import cached_profile
from moe_lightning.hrm.costmodel import estimate
from moe_lightning.hrm.explain import explain
from moe_lightning.hrm.layercost import Workload
from moe_lightning.hrm.optimizer import optimize
from moe_lightning.spec import ModelSpec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("models/demo-bench"))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--refresh", action="store_true", help="re-measure the hardware profile")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not (args.model / "config.json").exists():
        write_demo_model(args.model, "bench")
    spec = ModelSpec.from_pretrained(args.model)
    profile = cached_profile(spec, "cpu", refresh=args.refresh)
    work = Workload(args.prompt_len, args.gen)

    run = run_batch(
        args.model, random_prompts(args.batch, args.prompt_len, spec.vocab_size), args.gen, f"hrm{os.getpid()}"
    )
    resident = run.after["gpu_expert"].get("moe_lightning_resident_experts", 0.0)
    ran = policy_that_ran(run.policy(), resident, args.batch, None)
    est = estimate(spec, work, profile, ran, dtype="float32")
    dec = decode_totals(run)
    rows = stage_accuracy.compare(est, dec.timings, dec.steps, spec.num_layers)
    measured_tps = dec.tokens_per_second or float("nan")  # decode rows over their time, every step kind
    print(
        f"profile: {profile.name} ({profile.source}): matmul {profile.gpu_flops / 1e9:.0f} GFLOP/s, expert "
        f"weights {profile.gpu_bandwidth / 1e9:.2f} GB/s, attention KV {profile.cpu_bandwidth / 1e9:.2f} GB/s, "
        f"host and device shared: {profile.shared_host_device}"
    )
    print(
        f"policy that ran: batch {ran.batch} = {ran.num_micro_batches} x {ran.micro_batch_size}, attention on "
        f"{ran.attention.value}, experts on {ran.experts.value}, {ran.resident_experts} of {spec.total_experts} "
        f"expert pages resident; {dec.steps:.0f} decode steps"
    )
    print(f"HRM predicted vs measured, ms per layer of a decode step ({spec.num_layers} layers):")
    print("\n".join(stage_accuracy.table(rows)))
    tps, tps_error = est.tokens_per_second, est.tokens_per_second / measured_tps - 1
    print(f"  {'decode tokens/s (orchestrator)':32} {tps:9.1f} {measured_tps:9.1f} {'':9} {tps_error:+7.0%}")
    best = optimize(spec, work, profile, "float32", batch_cap=4096)
    print("\nwhat the optimizer picks on this machine:\n" + explain(str(args.model), spec, work, profile, best))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "policy": {
                        "batch": ran.batch,
                        "micro_batch": ran.micro_batch_size,
                        "attention": ran.attention.value,
                        "experts": ran.experts.value,
                        "resident_experts": ran.resident_experts,
                    },
                    "stages_per_layer": stage_accuracy.as_json(rows),
                    "tokens_per_second": {"predicted": est.tokens_per_second, "measured": measured_tps},
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
