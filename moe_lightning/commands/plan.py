"""plan: the HRM's best policy for a model, a workload and a machine, with the reasons."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from moe_lightning.flags import parse_size


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help="pick batch sizes and placement with the hierarchical roofline model")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", type=Path, help="HF checkpoint directory (its config.json)")
    what.add_argument("--arch", help="mixtral-8x7b, mixtral-8x22b or dbrx")
    p.add_argument(
        "--hardware",
        default="t4",
        help="t4, l4, a100-40g, h100, h200, a profile JSON file, or calibrate (this machine, cached)",
    )
    p.add_argument("--device", default="cpu", help="with --hardware calibrate: the device to measure")
    p.add_argument("--gpus", type=int, default=1, help="GPUs in tensor parallel")
    p.add_argument("--host-memory", type=parse_size, default=None, help="override the profile's host memory")
    p.add_argument("--prompt-len", type=float, default=77, help="average prompt tokens (MT-Bench: 77)")
    p.add_argument("--gen-len", type=int, default=32, help="tokens generated per request")
    p.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="weight dtype (default: the model's)"
    )
    p.add_argument(
        "--kv-dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the host KV cache (cpu_attention's --kv-dtype; default: the weight dtype): it decides how "
        "many sequences the host holds",
    )
    p.add_argument("--json", action="store_true", help="one JSON object instead of the explanation")
    p.add_argument("--plot", type=Path, default=None, help="draw the hierarchical roofline to this PNG")


def run(args: argparse.Namespace) -> int:
    from moe_lightning.hrm.archs import ARCHS
    from moe_lightning.hrm.costmodel import Workload
    from moe_lightning.hrm.explain import explain, host_kv, plan_to_dict
    from moe_lightning.hrm.hardware import load_profile
    from moe_lightning.hrm.optimizer import optimize
    from moe_lightning.spec import ModelSpec

    if args.arch is not None:
        if args.arch not in ARCHS:
            raise ValueError(f"unknown --arch {args.arch!r}; choose one of {', '.join(ARCHS)}")
        spec, name = ARCHS[args.arch], args.arch
    else:
        spec, name = ModelSpec.from_pretrained(args.model), str(args.model)
    if args.hardware == "calibrate":
        from moe_lightning.hrm.calibrate import cached_profile

        hw = cached_profile(spec, args.device).with_gpus(args.gpus)
    else:
        hw = load_profile(args.hardware).with_gpus(args.gpus)
    if args.host_memory is not None:
        hw = hw.scaled(cpu_memory=args.host_memory / hw.cpu_memory)
    work = Workload(args.prompt_len, args.gen_len)
    dtype = args.dtype or ("float32" if hw.shared_host_device else None)  # CPU compute runs fp32
    kv_dtype = args.kv_dtype or dtype or spec.dtype
    est = optimize(spec, work, hw, dtype, kv_dtype=kv_dtype)
    kv = host_kv(spec, work, hw, dtype, kv_dtype)
    if args.plot is not None:
        from moe_lightning.hrm.plot import plot_roofline

        plot_roofline(hw, est, f"{name} on {hw.name}, prompt {args.prompt_len:g} / gen {args.gen_len}", args.plot)
    if args.json:
        sys.stdout.write(json.dumps(plan_to_dict(name, spec, work, hw, est, kv)) + "\n")
    else:
        sys.stdout.write(explain(name, spec, work, hw, est, kv) + "\n")
    return 0
