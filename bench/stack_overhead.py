"""Stack vs in-process decode throughput, and what the process split costs per step and hand-off.

Runs, in one invocation and on the same checkpoint and batch:
  1. the in-process engine (every stage in one process): steady-state decode tokens/s;
  2. the four-service stack through BatchGenerate: steady-state decode tokens/s from the
     orchestrator's step metrics;
  3. per decode step, the control-plane time (orchestrator wall time minus gpu_expert's own step
     time: gRPC, protobuf, scheduling) and, per hand-off, the shared-memory time (what gpu_expert
     waits for attention beyond cpu_attention's compute, halved: there and back).

    python bench/stack_overhead.py [--model models/demo-bench] [--batch 16] [--prompt-len 64] [--gen 32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from moe_lightning.benchmark import decode_totals, random_prompts, run_batch
from moe_lightning.checkpoint import load_model_weights
from moe_lightning.demo_model import write_demo_model
from moe_lightning.engine import InProcessEngine
from moe_lightning.request import GenerationRequest
from moe_lightning.spec import ModelSpec


def in_process(model: Path, batch: list[list[int]], gen: int) -> dict[str, float]:
    spec = ModelSpec.from_pretrained(model)
    engine = InProcessEngine(spec, load_model_weights(model, spec, progress=False))
    engine.generate([GenerationRequest(batch[0][:8], 2, ignore_eos=True)])  # warm-up
    _, stats = engine.generate([GenerationRequest(p, gen, ignore_eos=True) for p in batch])
    return {
        "decode_tokens_per_second": stats.decode_tokens / stats.decode_seconds,
        "decode_step_seconds": stats.decode_seconds / stats.decode_steps,
        "prefill_seconds": stats.prefill_seconds,
    }


def stack(model: Path, batch: list[list[int]], gen: int, run_id: str, threads: int) -> dict[str, float]:
    run = run_batch(model, batch, gen, run_id, threads)
    done, wall, delta = run.done, run.wall_seconds, run.delta
    decode = decode_totals(run)  # every step that decoded, a mixed one at its decode share
    steps, step_s = decode.steps, decode.seconds
    generated = sum(d.completion_tokens for d in done)
    control = delta("orchestrator", "moe_lightning_control_plane_seconds_total")
    all_steps = steps + delta("orchestrator", 'moe_lightning_step_seconds_count{kind="prefill"}')
    wait = delta("gpu_expert", "moe_lightning_shm_wait_seconds_total")
    attn = sum(
        delta("cpu_attention", f'moe_lightning_stage_busy_seconds_total{{stage="{k}"}}')
        for k in ("decode_attention", "prefill_attention")
    )
    round_trips = delta("cpu_attention", 'moe_lightning_handoffs_total{direction="in"}')
    return {
        "decode_tokens_per_second": decode.tokens_per_second,
        "decode_step_seconds": step_s / steps,
        "generated_tokens_per_second_end_to_end": generated / wall,
        "control_plane_ms_per_step": 1e3 * control / all_steps,
        "handoff_us": 1e6
        * (
            delta("cpu_attention", 'moe_lightning_handoff_latency_seconds_total{direction="in"}')
            + delta("gpu_expert", 'moe_lightning_handoff_latency_seconds_total{direction="in"}')
        )
        / (2 * round_trips),
        "handoff_work_us": 1e6
        * sum(
            delta(svc, f'moe_lightning_handoff_work_seconds_total{{direction="{d}"}}')
            for svc in ("gpu_expert", "cpu_attention")
            for d in ("in", "out")
        )
        / (2 * round_trips),
        "attention_wait_beyond_compute_us": 1e6 * max(0.0, wait - attn) / round_trips,
        "handoffs": 2 * round_trips,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("models/demo-bench"))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per worker service (0 = default)")
    args = ap.parse_args()
    if not (args.model / "config.json").exists():
        sys.stderr.write(f"building the bench demo model in {args.model}...\n")
        write_demo_model(args.model, "bench")
    spec = ModelSpec.from_pretrained(args.model)
    batch = random_prompts(args.batch, args.prompt_len, spec.vocab_size)
    local = in_process(args.model, batch, args.gen)
    remote = stack(args.model, batch, args.gen, f"bench{os.getpid()}", args.threads)
    result = {
        "model": str(args.model),
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "gen": args.gen,
        "in_process": local,
        "stack": remote,
        "stack_over_in_process": remote["decode_tokens_per_second"] / local["decode_tokens_per_second"],
    }
    print(f"batch {args.batch} x prompt {args.prompt_len} tokens, {args.gen} generated each, {args.model}")
    print(
        f"  in-process decode        {local['decode_tokens_per_second']:8.1f} tok/s "
        f"({1e3 * local['decode_step_seconds']:.1f} ms/step)"
    )
    print(
        f"  stack decode             {remote['decode_tokens_per_second']:8.1f} tok/s "
        f"({1e3 * remote['decode_step_seconds']:.1f} ms/step)   ratio {result['stack_over_in_process']:.2f}"
    )
    print(f"  control plane per step   {remote['control_plane_ms_per_step']:8.2f} ms   (target < 2 ms)")
    print(
        f"  shared memory per hand-off {remote['handoff_work_us']:6.1f} us of work: copy, header, post "
        "(target < 100 us)"
    )
    print(
        f"                             {remote['handoff_us']:6.1f} us send-to-receive, with the wake-up of a "
        f"sleeping peer ({int(remote['handoffs'])} hand-offs)"
    )
    print(
        f"  expert waits on attention  {remote['attention_wait_beyond_compute_us']:6.1f} us per layer beyond "
        "attention compute"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
