"""make-demo-model: write a built-in HF-format checkpoint of any family (random weights, no download)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from moe_lightning.config import flags
from moe_lightning.families import FAMILY_NAMES


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help="write a built-in HF-format checkpoint with random weights (no download)")
    p.add_argument("--preset", default="tiny", help="tiny (a few MB) or bench (~0.8 B params, 3.2 GB fp32)")
    flags.OUT.add_to(p, required=True)
    flags.SEED.add_to(p, default=0)
    flags.DTYPE.add_to(p, default="auto")  # auto: float32, the dtype a checkpoint written on a CPU keeps
    p.add_argument("--family", default="mixtral", choices=FAMILY_NAMES, help="the model family to write")


def run(args: argparse.Namespace) -> int:
    from moe_lightning.demo_model import write_demo_model
    from moe_lightning.spec import resolve_dtype

    t0 = time.perf_counter()
    dtype = resolve_dtype(args.dtype, "float32", "cpu")
    out = write_demo_model(args.out, args.preset, seed=args.seed, dtype=dtype, arch=args.family)
    sys.stderr.write(f"wrote {args.preset} demo model to {out} in {time.perf_counter() - t0:.1f} s\n")
    return 0
