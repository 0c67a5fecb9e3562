"""How well the HRM predicts this machine: predicted vs measured decode time per stage and tokens/s.

Calibrates the roofs with our own kernels (cached per machine; --refresh re-measures), runs one
batch through the four-service stack, and compares, per layer of a decode step and at the policy
that ran (batch N, one micro-batch), the cost model's stage times with the services' own busy
time. Also prints what the optimizer would pick here. The error is a number we track; the target
is within 25 %.

    python bench/hrm_accuracy.py [--model models/demo-bench] [--batch 16] [--prompt-len 64] [--gen 32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from moe_lightning.benchmark import random_prompts, run_batch
from moe_lightning.demo_model import write_demo_model
from moe_lightning.hrm.calibrate import cached_profile
from moe_lightning.hrm.costmodel import Policy, Workload, estimate
from moe_lightning.hrm.explain import explain
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
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    profile = cached_profile(spec, "cpu", refresh=args.refresh)
    work = Workload(args.prompt_len, args.gen)
    est = estimate(spec, work, profile, Policy(args.batch, args.batch), dtype="float32")

    run = run_batch(
        args.model, random_prompts(args.batch, args.prompt_len, spec.vocab_size), args.gen, f"hrm{os.getpid()}"
    )
    d = run.delta
    steps = d("orchestrator", 'moe_lightning_step_seconds_count{kind="decode"}')
    per_layer = 1.0 / (steps * spec.num_layers)
    decode_attn = d("cpu_attention", 'moe_lightning_stage_busy_seconds_total{stage="decode_attention"}')
    # gpu_expert's busy time covers prefill too; scale it to the decode steps by its step counts
    gpu_steps = d("gpu_expert", 'moe_lightning_steps_total{kind="decode"}')
    all_gpu_steps = gpu_steps + d("gpu_expert", 'moe_lightning_steps_total{kind="prefill"}')
    share = gpu_steps / all_gpu_steps if all_gpu_steps else 1.0

    def busy(stage: str) -> float:
        return d("gpu_expert", f'moe_lightning_stage_busy_seconds_total{{stage="{stage}"}}')

    measured = {
        "device dense + experts": (busy("pre_attention") + busy("post_attention")) * share * per_layer,
        "attention": decode_attn * per_layer,
        "head": busy("head") * share * per_layer,
        "layer (whole decode step / L)": d("orchestrator", 'moe_lightning_step_seconds_sum{kind="decode"}') * per_layer,
    }
    s = est.stage_seconds
    predicted = {
        "device dense + experts": s["gpu_dense"] + s["gpu_experts"],
        "attention": s["cpu_attention"],
        "head": s["gpu_head"],
        "layer (whole decode step / L)": est.layer_seconds,
    }
    decode_tokens = sum(c.completion_tokens for c in run.done) - len(run.done)
    measured_tps = decode_tokens / d("orchestrator", 'moe_lightning_step_seconds_sum{kind="decode"}')
    print(
        f"profile: {profile.name} ({profile.source}): matmul {profile.gpu_flops / 1e9:.0f} GFLOP/s, expert "
        f"weights {profile.gpu_bandwidth / 1e9:.2f} GB/s, attention KV {profile.cpu_bandwidth / 1e9:.2f} GB/s, "
        f"host and device shared: {profile.shared_host_device}"
    )
    print(f"policy that ran: batch {args.batch}, one micro-batch, attention on cpu, experts on the (cpu) device")
    print(f"{'stage (per layer, decode)':32} {'predicted ms':>13} {'measured ms':>12} {'error':>8}")
    errors = {}
    for k in predicted:
        errors[k] = predicted[k] / measured[k] - 1 if measured[k] else float("nan")
        print(f"{k:32} {1e3 * predicted[k]:13.2f} {1e3 * measured[k]:12.2f} {errors[k]:+8.0%}")
    tps_error = est.tokens_per_second / measured_tps - 1
    print(f"{'decode tokens/s':32} {est.tokens_per_second:13.1f} {measured_tps:12.1f} {tps_error:+8.0%}")
    best = optimize(spec, work, profile, "float32", batch_cap=4096)
    print("\nwhat the optimizer picks on this machine:\n" + explain(str(args.model), spec, work, profile, best))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "predicted": predicted,
                    "measured": measured,
                    "errors": errors,
                    "tokens_per_second": {"predicted": est.tokens_per_second, "measured": measured_tps},
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
