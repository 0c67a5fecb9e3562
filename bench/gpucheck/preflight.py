"""The GPU check's preflight constants: what it runs and what it keeps of a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.gpucheck import log

PREFLIGHT_KV = 256 << 20  # gpu_expert's KV cache when the preflight puts attention on the device
# Run in a phase of their own when pytest is importable: the CUDA cases skip without a GPU
CUDA_TESTS = (
    "tests/test_cuda_copy.py",
    "tests/test_pipeline.py",
    "tests/test_tensor_parallel_faults.py::test_two_ranks_on_one_gpu_stream_their_slices_and_come_back_after_a_kill",
    # --quantize-dense int8 at start: a vocabulary-sized head dequantized and quantized in bounded blocks
    "tests/test_dequant_blocks.py::test_cuda_dequant_mm_of_an_int8_head_peaks_at_one_block",
    "tests/test_dequant_blocks.py::test_cuda_quantize_dense_of_a_bf16_head_peaks_at_one_block",
)


def preflight_facts(bench: dict[str, Any]) -> dict[str, Any]:
    """What a preflight run shows beyond its speed: it ran, in how many micro-batches, how often the
    host synchronised with the device per decode step, how much host memory was pinned."""
    ours = bench["ours"]
    keys = ("micro_batches", "host_syncs_per_decode_step", "pinned_host_bytes", "residency_changes", "policy")
    return {"ok": True, **{k: ours.get(k) for k in keys}}


def preflight_sizes(dry_run: bool) -> tuple[int, int]:
    """Prompts and tokens per preflight run: a dry run (CPU) keeps the 8 micro-batches of one sequence
    each and 3 decode steps (a residency update every 2), in half the prompts."""
    return (8, 4) if dry_run else (16, 6)


def run_preflight(check: Any, toy_dir: Path, toy: dict[str, Any]) -> str | None:
    """The bench on the toy model (`toy`: its config) through the paths a first GPU run breaks (8
    micro-batches: more than the channel slots; hot-expert residency every 2 decode steps; host syncs
    counted), through `check` (a PhaseRunner); the first dtype of the requested and the fallback one it
    works in, or None."""
    from bench.gpucheck.budget import device_budget
    from moe_lightning.demo_model import mixtral_config
    from moe_lightning.spec import ModelSpec

    a = check.args
    spec = ModelSpec.from_hf_config(mixtral_config(toy, "bfloat16"))
    n, gen = preflight_sizes(a.dry_run)
    for dtype in [a.dtype] + ([a.fallback_dtype] if a.fallback_dtype not in ("none", a.dtype) else []):
        budget = device_budget(spec, dtype, a.resident_fraction)
        # ours only: its baseline (b) runs in the `ours` phase; here it would cost device time for nothing
        flags = ("--micro-batches", "8", "--residency-interval", "2", "--count-syncs", "--skip-overlap-off")
        name = f"preflight-{dtype}"
        result = check.bench(name, toy_dir, budget.device_memory, dtype, n, gen, check.timeout(90, 200), True, flags)
        if result is None or not check.report["phases"][name].get("ok"):  # its run, whole
            continue
        check.report.setdefault("preflight", {})[name] = preflight_facts(result)
        if dtype != a.dtype:
            check.report["dtype_fallback"] = f"our stack failed in {a.dtype} on the toy model; ours runs in {dtype}"
            log(f"WARNING: {check.report['dtype_fallback']}")
        return dtype
    return None
