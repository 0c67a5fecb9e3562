"""profile: measure this machine's roofs with our kernels and cache them for `plan --hardware calibrate`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help="calibrate the hardware profile of this machine (cached)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", type=Path, help="HF checkpoint directory: measure at its shapes")
    what.add_argument("--arch", help="mixtral-8x7b, mixtral-8x22b or dbrx")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--out", type=Path, default=None, help="also write the profile JSON here")
    p.add_argument("--cached", action="store_true", help="reuse the cached profile instead of re-measuring")
    p.add_argument(
        "--quantize",
        default="none",
        choices=["none", "int8", "int4"],
        help="also measure the expert GEMM on pages of this format (for plan --hardware calibrate --quantize)",
    )
    p.add_argument("--quantize-group-size", type=int, default=128, help="int4 group size (32, 64, 128, or -1)")


def run(args: argparse.Namespace) -> int:
    from moe_lightning.hrm.archs import ARCHS
    from moe_lightning.hrm.calibrate import cached_profile
    from moe_lightning.quant.scheme import parse_quantize
    from moe_lightning.spec import ModelSpec

    if args.arch is not None and args.arch not in ARCHS:
        raise ValueError(f"unknown --arch {args.arch!r}; choose one of {', '.join(ARCHS)}")
    spec = ARCHS[args.arch] if args.arch else ModelSpec.from_pretrained(args.model)
    quant = parse_quantize(args.quantize, args.quantize_group_size)
    profile = cached_profile(spec, args.device, refresh=not args.cached, quant=quant)
    if args.out is not None:
        args.out.write_text(profile.to_json())
    sys.stdout.write(profile.to_json() + "\n")
    return 0
