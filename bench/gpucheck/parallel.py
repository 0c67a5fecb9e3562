"""The GPU check's tensor-parallel phase (issue 16, docs/parallel.md): `bench --gpus 2` on the one GPU
of the check. NCCL refuses two ranks on one device, so the ranks all-reduce over gloo (CUDA tensors
through the host), each with half the budget: what runs is each rank's pinned streaming of its
slices, the gathers and scatters of the hand-off, and the all-reduces; what does not is NCCL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ONE_GPU_ENV = {"MOE_LIGHTNING_TP_BACKEND": "gloo", "MOE_LIGHTNING_TP_SAME_DEVICE": "1"}  # gpu_expert's flags


def run_tensor_parallel(
    check: Any, name: str, model: Path, budget: Any, dtype: str, prompts: int, gen_len: int, timeout: float
) -> None:
    """Runs the phase through `check.bench` (a PhaseRunner) and files its numbers under `name`."""
    half = budget.device_memory // 2
    saved = dict(check.env)
    check.env.update(ONE_GPU_ENV)
    try:
        # ours only: what the phase files; (b) at two ranks would cost device time for nothing
        extra = ("--gpus", "2", "--skip-overlap-off")
        result = check.bench(name, model, half, dtype, prompts, gen_len, timeout, extra=extra)
    finally:
        check.env.clear()
        check.env.update(saved)
    if result is None:
        return
    ours = result["ours"]
    keep = ("decode_tokens_per_second", "generated_tokens_per_second", "expert_bytes_per_step", "policy")
    check.report[name] = {
        **{k: ours.get(k) for k in keep},
        "per_rank": result.get("tensor_parallel"),
        "device_memory_per_rank": half,
        "backend": "gloo, both ranks on one GPU",
    }
    check.save()
