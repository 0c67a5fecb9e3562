"""plan: the HRM's best policy for a model, a workload and a machine, with the reasons."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_lightning.config import flags
from moe_lightning.config.checks import resolve_expert_scheme
from moe_lightning.config.units import parse_size

if TYPE_CHECKING:
    from moe_lightning.hrm.hardware import HardwareProfile
    from moe_lightning.hrm.layercost import Workload
    from moe_lightning.quant.scheme import QuantScheme
    from moe_lightning.spec import ModelSpec


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help="pick batch sizes and placement with the hierarchical roofline model")
    what = p.add_mutually_exclusive_group(required=True)
    flags.MODEL.add_to(what)  # its config.json
    flags.ARCH.add_to(what)
    p.add_argument(
        "--hardware",
        default="t4",
        help="t4, l4, a100-40g, h100, h200, a profile JSON file, or calibrate (this machine, cached)",
    )
    flags.DEVICE.add_to(p, default="cpu")  # with --hardware calibrate: the device to measure
    flags.GPUS.add_to(p, default=1)
    p.add_argument("--host-memory", type=parse_size, default=None, help="override the profile's host memory")
    p.add_argument("--prompt-len", type=float, default=77, help="average prompt tokens (MT-Bench: 77)")
    flags.GEN_LEN.add_to(p, default=32)
    flags.DTYPE.add_to(p, default="auto")
    flags.KV_DTYPE.add_to(p, default="auto")  # it decides how many sequences the host holds
    flags.QUANTIZE.add_to(p, default="auto")
    flags.QUANTIZE_GROUP_SIZE.add_to(p)
    flags.COMPARE_QUANTIZE.add_to(p)
    flags.JSON.add_to(p, default=False)  # one JSON object instead of the explanation
    p.add_argument("--plot", type=Path, default=None, help="draw the hierarchical roofline to this PNG")


def _dtypes(args: argparse.Namespace, spec: ModelSpec, hw: HardwareProfile) -> tuple[str, str]:
    """(weights, KV cache) as `up` would resolve auto on this hardware: fp32 where the device is the
    host's CPU, else the checkpoint's 16-bit dtype; the KV cache in the weights'."""
    from moe_lightning.spec import resolve_dtype

    dtype = resolve_dtype(args.dtype, spec.dtype, "cpu" if hw.shared_host_device else "cuda")
    return dtype, dtype if args.kv_dtype == "auto" else args.kv_dtype


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
    from moe_lightning.hrm.explain import explain, host_kv, plan_to_dict
    from moe_lightning.hrm.layercost import Workload
    from moe_lightning.hrm.optimizer import optimize
    from moe_lightning.spec import ModelSpec

    if args.arch is not None:
        if args.arch not in ARCHS:
            raise ValueError(f"unknown --arch {args.arch!r}; choose one of {', '.join(ARCHS)}")
        spec, name = ARCHS[args.arch], args.arch
    else:
        spec, name = ModelSpec.from_pretrained(args.model), str(args.model)
    work = Workload(args.prompt_len, args.gen_len)
    if args.compare_quantize:
        return _compare(args, spec, name, work)
    quant = resolve_expert_scheme(spec, args.model, args.quantize, args.quantize_group_size, args.gpus)
    hw = _profile(args, spec, quant)
    dtype, kv_dtype = _dtypes(args, spec, hw)
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


def _compare(args: argparse.Namespace, spec: ModelSpec, name: str, work: Workload) -> int:
    """The best plan for each expert page format asked for, one row each (or their JSON plans)."""
    from moe_lightning.hrm.explain import link_bytes_per_step, plan_to_dict
    from moe_lightning.hrm.optimizer import optimize
    from moe_lightning.quant.scheme import QuantFormat

    plans = []
    for fmt in args.compare_quantize:
        quant = resolve_expert_scheme(spec, None, fmt, args.quantize_group_size, args.gpus)
        hw = _profile(args, spec, quant)
        dtype, kv_dtype = _dtypes(args, spec, hw)
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
            f"{f'{p.batch} = {p.num_micro_batches} x {p.micro_batch_size}':>20} "
            f"{link_bytes_per_step(spec, est)['total'] / 1e9:13.2f} {est.binding:>6} "
            f"{est.tokens_per_second:9.1f} {est.tokens_per_second / base:7.2f}x"
        )
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
