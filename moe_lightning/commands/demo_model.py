"""make-demo-model: write a built-in HF-format Mixtral checkpoint."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help="write a built-in HF-format Mixtral checkpoint (no download)")
    p.add_argument("--preset", default="tiny", help="tiny (a few MB) or bench (~0.8 B params, 3.2 GB fp32)")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="weights and tokenizer are deterministic by seed")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--arch", default="mixtral", choices=["mixtral", "olmoe", "qwen2-moe", "qwen3-moe", "dbrx"], help="model family"
    )


def run(args: argparse.Namespace) -> int:
    from moe_lightning.demo_model import write_demo_model

    t0 = time.perf_counter()
    out = write_demo_model(args.out, args.preset, seed=args.seed, dtype=args.dtype, arch=args.arch)
    sys.stderr.write(f"wrote {args.preset} demo model to {out} in {time.perf_counter() - t0:.1f} s\n")
    return 0
