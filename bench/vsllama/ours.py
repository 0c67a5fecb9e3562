"""Our stack on the batch: a fresh stack per run (moe_lightning.benchmark.run_batch, as `moe-lightning
bench` runs ours), the whole model on the CPU "device" (on a CPU the experts compute on the host's
cores either way), the experts in the format asked, `threads` torch threads in each worker.

The prefill budget is the batch's prompt tokens, so the first step prefills every prompt and every
later step is a decode of the whole batch: the decode figure is then exactly the decode steps'
tokens over their time (the orchestrator's step wall times), llama.cpp's phases are the same two, and
a mixed step (prefill beside decode, whose time is neither phase's alone) never happens here; the
result says so if one did."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.vsllama import log
from bench.vsllama.formats import Format

STEP_KINDS = ("prefill", "decode", "mixed")


def _steps(delta: Any, kind: str) -> tuple[float, float]:
    """(steps, seconds) of one kind during the batch, from the orchestrator's step histogram."""
    return (
        delta("orchestrator", f'moe_lightning_step_seconds_count{{kind="{kind}"}}'),
        delta("orchestrator", f'moe_lightning_step_seconds_sum{{kind="{kind}"}}'),
    )


def decode_breakdown(run: Any, decode_steps: float, decode_seconds: float) -> dict[str, float]:
    """Milliseconds per decode step: gpu_expert's stages (StepTimings), cpu_attention's busy time, and
    the orchestrator's wall time beyond gpu_expert's step (the control plane: scheduling, the Step RPC,
    detokenizing)."""
    from moe_lightning.benchmark import decode_totals

    if not decode_steps:
        return {}
    totals = decode_totals(run)
    per_step = {stage: s * 1e3 / decode_steps for stage, s in totals.seconds_by_stage().items() if s}
    per_step["orchestrator_wall"] = decode_seconds * 1e3 / decode_steps
    per_step["control_plane"] = per_step["orchestrator_wall"] - per_step.get("step", 0.0)
    return per_step


def run_ours(
    model: Path, prompts: list[list[int]], gen_len: int, fmt: Format, threads: int, micro_batch: int | None = None
) -> dict[str, Any]:
    """One batch through a fresh stack; the phases' times and tok/s, the policy, where a decode step's time
    went. `micro_batch`: sequences per micro-batch (0: the whole batch); None: the HRM's choice."""
    from moe_lightning.benchmark import run_batch
    from moe_lightning.commands.bench_formats import kernels_chosen

    n = len(prompts)
    t0 = time.monotonic()
    run = run_batch(
        model,
        prompts,
        gen_len,
        f"vsllama{fmt.name.replace('-', '')}{n}",
        threads=threads,
        micro_batch=micro_batch,
        device="cpu",
        dtype="float32",
        quantize=fmt.quantize,
        quantize_group_size=fmt.group_size,
        quantize_dense=fmt.quantize_dense,
        prefill_budget=sum(map(len, prompts)),
    )
    d = run.delta
    steps = {kind: _steps(d, kind) for kind in STEP_KINDS}
    generated = sum(c.completion_tokens for c in run.done)
    decode_steps, decode_s = steps["decode"]
    prefill_s = steps["prefill"][1] + steps["mixed"][1]
    took = time.monotonic() - t0
    log(f"ours {fmt.name}: {generated} tokens in {run.wall_seconds:.1f} s ({took:.0f} s with its start and stop)")
    return {
        "seconds": run.wall_seconds,
        "prefill_seconds": prefill_s,
        "decode_seconds": decode_s,
        "generated_tokens": generated,
        "e2e_tokens_per_second": generated / run.wall_seconds,
        # each sequence's first token comes from its prefill: the decode steps make the rest
        "decode_tokens_per_second": (generated - n) / decode_s if decode_s else 0.0,
        "steps": {kind: int(count) for kind, (count, _) in steps.items()},
        "decode_ms_per_step": decode_breakdown(run, decode_steps, decode_s),
        "policy": run.policy(),  # the planner's labels: its micro-batch even where one was fixed
        "micro_batch_size": micro_batch,  # fixed for this run (None: the planner's)
        "kernels": kernels_chosen(run.after["gpu_expert"]),
        "dense_kernels": kernels_chosen(run.after["gpu_expert"], "dense"),
        "token_ids": [c.token_ids for c in run.done],
    }
