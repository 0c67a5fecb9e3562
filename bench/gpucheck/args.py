"""bench/gpu_check.py's command line: the flags and their defaults, on the GPU and in a dry run."""

from __future__ import annotations

import argparse
from pathlib import Path

OPTIONAL = ("cuda-tests", "formats", "tensor-parallel", "device-attention")  # in the order they run
# the dry run's batch cap: its prompts (~77 tokens each, 19.7k in all) take 3 alternating prefill steps of
# --max-prefill-tokens 8192, as the GPU run's 1,024 take ~10: admission spans steps in both
DRY_RUN_BATCH = 256


def parse_args(argv: list[str], doc: str | None = None) -> argparse.Namespace:
    """gpu_check.py's command line (`doc`: its help text), with the dry run's defaults filled in."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--batch-cap",
        type=int,
        default=None,
        help="largest batch the HRM may pick (default 1024; dry run 256: admission then takes several steps)",
    )
    p.add_argument("--gen-len", type=int, default=None, help="tokens generated per prompt (default 32; dry run 4)")
    p.add_argument(
        "--profile",
        default="auto",
        help="the HRM's hardware profile: auto (the preset of the GPU's name: h100, h200, ...), a preset name or a "
        "profile JSON",
    )
    p.add_argument(
        "--resident-fraction", type=float, default=0.2, help="share of the experts the budget keeps resident"
    )
    p.add_argument("--dtype", default=None, help="our arena's dtype (default bfloat16; dry run float32)")
    p.add_argument("--fallback-dtype", default="float32", help="dtype to try when the preflight fails ('none': off)")
    p.add_argument("--seed", type=int, default=0, help="the checkpoint's weights")
    p.add_argument(
        "--work-dir",
        default=None,
        help="checkpoints, arena copy, logs (default: a new private directory under the temp dir; a given "
        "one is created 0700 and refused if another user could write to it)",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="where gpu_check.json and the log archive go (default: WORK_DIR/out)"
    )
    p.add_argument("--deadline", type=float, default=None, help="seconds for everything (default 330; dry run 300)")
    p.add_argument("--preflight", choices=["auto", "on", "off"], default="auto", help="the toy-model run (auto: on)")
    phases = ", ".join(("ours", "offload", "preflight", *OPTIONAL))
    p.add_argument("--skip", default="", help=f"phases to leave out, comma-separated: {phases}")
    p.add_argument("--formats-on", choices=["toy", "checkpoint"], default="toy", help="the formats phase's model")
    p.add_argument("--with-transformers", action="store_true", help="also bench's baseline (a) (CPU, fp32: slow)")
    p.add_argument("--predict-only", action="store_true", help="print the HRM's pick and prediction, run nothing")
    p.add_argument("--dry-run", action="store_true", help="the toy model on the CPU: checks the flow, not speed")
    a = p.parse_args(argv)
    a.device = "cpu" if a.dry_run else "cuda"
    a.batch_cap = a.batch_cap or (DRY_RUN_BATCH if a.dry_run else 1024)
    a.gen_len = a.gen_len or (4 if a.dry_run else 32)
    a.dtype = a.dtype or ("float32" if a.dry_run else "bfloat16")
    a.deadline = a.deadline or (300.0 if a.dry_run else 330.0)
    a.preflight = a.preflight in ("on", "auto")
    a.skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    return a
