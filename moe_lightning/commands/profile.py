"""profile: measure this machine's roofs with our kernels and cache them for `plan --hardware calibrate`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from moe_lightning.config import flags


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help="calibrate the hardware profile of this machine (cached)")
    what = p.add_mutually_exclusive_group(required=True)
    flags.MODEL.add_to(what)  # measure at its shapes
    flags.ARCH.add_to(what)
    flags.DEVICE.add_to(p, default="cpu")
    flags.OUT.add_to(p)
    p.add_argument("--cached", action="store_true", help="reuse the cached profile instead of re-measuring")
    # also measure the expert GEMM on pages of this format (for plan --hardware calibrate --quantize)
    flags.QUANTIZE.add_to(p, default="auto")
    flags.QUANTIZE_GROUP_SIZE.add_to(p)


def run(args: argparse.Namespace) -> int:
    from moe_lightning.config.checks import resolve_expert_scheme
    from moe_lightning.hrm.archs import ARCHS
    from moe_lightning.hrm.calibrate import cached_profile
    from moe_lightning.spec import ModelSpec

    if args.arch is not None and args.arch not in ARCHS:
        raise ValueError(f"unknown --arch {args.arch!r}; choose one of {', '.join(ARCHS)}")
    spec = ARCHS[args.arch] if args.arch else ModelSpec.from_pretrained(args.model)
    quant = resolve_expert_scheme(spec, args.model, args.quantize, args.quantize_group_size)
    profile = cached_profile(spec, args.device, refresh=not args.cached, quant=quant)
    if args.out is not None:
        args.out.write_text(profile.to_json())
    sys.stdout.write(profile.to_json() + "\n")
    return 0
