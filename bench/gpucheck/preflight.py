"""The GPU check's preflight constants: what it runs and what it keeps of a run."""

from __future__ import annotations

from typing import Any

PREFLIGHT_KV = 256 << 20  # gpu_expert's KV cache when the preflight puts attention on the device
# Run in a phase of their own when pytest is importable: the CUDA cases skip without a GPU
CUDA_TESTS = (
    "tests/test_cuda_copy.py",
    "tests/test_pipeline.py",
    "tests/test_tensor_parallel_faults.py::test_two_ranks_on_one_gpu_stream_their_slices_and_come_back_after_a_kill",
)


def preflight_facts(bench: dict[str, Any]) -> dict[str, Any]:
    """What a preflight run shows beyond its speed: it ran, in how many micro-batches, how often the
    host synchronised with the device per decode step, how much host memory was pinned."""
    ours = bench["ours"]
    keys = ("micro_batches", "cuda_syncs_per_decode_step", "pinned_host_bytes", "residency_changes", "policy")
    return {"ok": True, **{k: ours.get(k) for k in keys}}


def preflight_sizes(dry_run: bool) -> tuple[int, int]:
    """Prompts and tokens per preflight run: a dry run (CPU) keeps the 8 micro-batches of one sequence
    each and 3 decode steps (a residency update every 2), in half the prompts."""
    return (8, 4) if dry_run else (16, 6)
