"""plan: the HRM's best policy for a model, a workload and a machine, with the reasons."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_lightning.flags import parse_size

if TYPE_CHECKING:
    from moe_lightning.hrm.costmodel import Workload
    from moe_lightning.hrm.hardware import HardwareProfile
    from moe_lightning.quant.scheme import QuantScheme
    from moe_lightning.spec import ModelSpec


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
    p.add_argument(
        "--quantize",
        default="none",
        choices=["none", "int8", "int4"],
        help="format of the expert pages (the weight store's --quantize): smaller pages stream faster and leave "
        "room for more resident experts and a larger batch; dense weights stay in the model dtype",
    )
    p.add_argument(
        "--quantize-group-size", type=int, default=128, help="int4 group size (32, 64, 128, or -1: one per row)"
    )
    p.add_argument(
        "--compare-quantize",
        action="store_true",
        help="plan for every expert page format (none, int8, int4) and print them side by side",
    )
    p.add_argument("--json", action="store_true", help="one JSON object instead of the explanation")
    p.add_argument("--plot", type=Path, default=None, help="draw the hierarchical roofline to this PNG")


def _profile(args: argparse.Namespace, spec: ModelSpec, quant: QuantScheme) -> HardwareProfile:
    from moe_lightning.hrm.hardware import load_profile

    if args.hardware == "calibrate":
        from moe_lightning.hrm.calibrate import cached_profile

        hw = cached_profile(spec, args.device, quant=quant).with_gpus(args.gpus)
    else:
        hw = load_profile(args.hardware).with_gpus(args.gpus)
    if args.host_memory is not None:
        hw = hw.scaled(cpu_memory=args.host_memory / hw.cpu_memory)
    return hw


def run(args: argparse.Namespace) -> int:
    from moe_lightning.hrm.archs import ARCHS
    from moe_lightning.hrm.costmodel import Workload
    from moe_lightning.hrm.explain import explain, host_kv, plan_to_dict
    from moe_lightning.hrm.optimizer import optimize
    from moe_lightning.quant.scheme import parse_quantize
    from moe_lightning.spec import ModelSpec

    if args.arch is not None:
        if args.arch not in ARCHS:
            raise ValueError(f"unknown --arch {args.arch!r}; choose one of {', '.join(ARCHS)}")
        spec, name = ARCHS[args.arch], args.arch
    else:
        spec, name = ModelSpec.from_pretrained(args.model), str(args.model)
    quant = parse_quantize(args.quantize, args.quantize_group_size)
    work = Workload(args.prompt_len, args.gen_len)
    if args.compare_quantize:
        return _compare(args, spec, name, work, args.quantize_group_size)
    hw = _profile(args, spec, quant)
    dtype = args.dtype or ("float32" if hw.shared_host_device else None)  # CPU compute runs fp32
    kv_dtype = args.kv_dtype or dtype or spec.dtype
    est = optimize(spec, work, hw, dtype, kv_dtype=kv_dtype, quant=quant)
    kv = host_kv(spec, work, hw, dtype, kv_dtype, quant=quant)
    if args.plot is not None:
        from moe_lightning.hrm.plot import plot_roofline

        plot_roofline(hw, est, f"{name} on {hw.name}, prompt {args.prompt_len:g} / gen {args.gen_len}", args.plot)
    if args.json:
        sys.stdout.write(json.dumps(plan_to_dict(name, spec, work, hw, est, kv)) + "\n")
    else:
        sys.stdout.write(explain(name, spec, work, hw, est, kv) + "\n")
    return 0


def _compare(args: argparse.Namespace, spec: ModelSpec, name: str, work: Workload, group_size: int) -> int:
    """The best plan for each expert page format, one row each (or their JSON plans)."""
    from moe_lightning.hrm.explain import link_bytes_per_step, plan_to_dict
    from moe_lightning.hrm.optimizer import optimize
    from moe_lightning.quant.scheme import QuantFormat, parse_quantize

    plans = []
    for fmt in QuantFormat:
        quant = parse_quantize(fmt.value, group_size)
        hw = _profile(args, spec, quant)
        dtype = args.dtype or ("float32" if hw.shared_host_device else None)
        kv_dtype = args.kv_dtype or dtype or spec.dtype
        plans.append((quant, hw, optimize(spec, work, hw, dtype, kv_dtype=kv_dtype, quant=quant)))
    if args.json:
        out = {"model": name, "plans": [plan_to_dict(name, spec, work, hw, est) for _, hw, est in plans]}
        sys.stdout.write(json.dumps(out) + "\n")
        return 0
    hw = plans[0][1]
    lines = [
        f"{name} on {hw.name}: prompt {work.prompt_len:g} tokens, {work.gen_len} generated",
        f"{'pages':<10} {'MB/page':>8} {'resident':>10} {'batch = n_ub x mu':>20} {'link GB/step':>13} "
        f"{'bound':>6} {'tokens/s':>9} {'vs none':>8}",
    ]
    base = plans[0][2].tokens_per_second
    for quant, _, est in plans:
        p = est.policy
        label = quant.format.value + (f" g{quant.group_size}" if quant.format is QuantFormat.INT4 else "")
        lines.append(
            f"{label:<10} {est.page_bytes / 1e6:8.1f} {p.resident_experts:>5}/{spec.total_experts:<4} "
            f"{f'{p.batch} = {p.num_micro_batches} x {p.micro_batch}':>20} "
            f"{link_bytes_per_step(spec, est)['total'] / 1e9:13.2f} {est.binding:>6} "
            f"{est.tokens_per_second:9.1f} {est.tokens_per_second / base:7.2f}x"
        )
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
