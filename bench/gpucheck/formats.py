"""The GPU check's expert-format phase (issue 15, docs/quantization.md): `bench --quantize
none,int8,int4`, each format's experts streamed at the dense weights plus 25 % of its expert pages.
Where the link binds, int4's decode tok/s over the model dtype's is the number to read (target 2x)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

FORMATS = "none,int8,int4"
DRY_RUN_FORMATS = "none,int4"  # int8's path is bench's own test's (tests/test_bench.py); 11 s of CPU
INT4_OVER_NONE = 2.0


def run_formats(
    check: Any,
    name: str,
    model: Path,
    dtype: str,
    prompts: int,
    gen_len: int,
    timeout: float,
    group_size: int = 128,
    formats: str = FORMATS,
) -> None:
    """Runs the phase through `check.bench` (a PhaseRunner) and files its numbers under `name`
    (`group_size`: int4's, 32 for the toy model's narrow widths). The budget is a share of each
    format's own arena (bench's --device-memory 25%)."""
    extra = ("--compare-quantize", formats, "--quantize-group-size", str(group_size))
    result = check.bench(name, model, "25%", dtype, prompts, gen_len, timeout, extra=extra)
    if result is None:
        return
    runs = result["formats"]
    ratio = runs["int4"]["decode_tokens_per_second"] / max(1e-9, runs["none"]["decode_tokens_per_second"])
    keep = ("decode_tokens_per_second", "expert_bytes_per_step", "device_memory", "kernels", "ratios")
    check.report[name] = {f: {k: r.get(k) for k in keep} for f, r in runs.items()}
    check.report[name]["int4_over_none"] = {"value": ratio, "target": INT4_OVER_NONE, "met": ratio >= INT4_OVER_NONE}
    check.save()
