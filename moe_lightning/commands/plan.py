"""plan: the HRM's best policy for a model, a workload and a machine, with the reasons."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_lightning.config import flags
from moe_lightning.config.checks import compared_group_size, resolve_expert_scheme
from moe_lightning.config.choices import EXPERT_GROUP_CHOICES
from moe_lightning.config.units import parse_size

if TYPE_CHECKING:
    from moe_lightning.hrm.hardware import HardwareProfile
    from moe_lightning.hrm.layercost import Workload
    from moe_lightning.quant.scheme import QuantScheme
    from moe_lightning.spec import ModelSpec


# hrm.layercost.KV_RULES, spelled here so that building the parser imports no numpy (tests/test_plan.py)
KV_RULE_CHOICES = ("expected", "max")


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
    p.add_argument(
        "--prompt-std",
        type=float,
        default=None,
        help="standard deviation of the prompt lengths (default: MT-Bench's spread, 0.82 x --prompt-len)",
    )
    flags.GEN_LEN.add_to(p, default=32)
    p.add_argument(
        "--kv-rule",
        choices=KV_RULE_CHOICES,
        default=KV_RULE_CHOICES[0],
        help="how the host KV cache holds sequences: expected (KV taken as they grow, the orchestrator's "
        "--kv-admission need: s + n/2 each on average, plus headroom) or max (reserved at s + n, the paper's rule "
        "and --kv-admission reserve)",
    )
    p.add_argument(
        "--compare-paper",
        action="store_true",
        help="T4 and L4 at gen 32/64/128/256: the paper's rule (16-bit KV, maximum context, alternating steps, "
        "experts once per micro-batch) against ours (8-bit KV or --kv-dtype, expected use, mixed steps, "
        "--expert-groups), predicted decode and prefill-inclusive tokens/s side by side",
    )
    flags.EXPERT_GROUPS.add_to(p, default=None)  # None (auto): the HRM picks among EXPERT_GROUP_CHOICES
    flags.DTYPE.add_to(p, default="auto")
    flags.KV_DTYPE.add_to(p, default="auto")  # it decides how many sequences the host holds
    flags.QUANTIZE.add_to(p, default="auto")
    flags.QUANTIZE_GROUP_SIZE.add_to(p)
    flags.COMPARE_QUANTIZE.add_to(p)
    flags.JSON.add_to(p, default=False)  # one JSON object instead of the explanation
    p.add_argument("--plot", type=Path, default=None, help="draw the hierarchical roofline to this PNG")


def _groups(args: argparse.Namespace) -> tuple[int, ...]:
    """The expert-group choices the search may pick: --expert-groups fixed, or auto's."""
    return EXPERT_GROUP_CHOICES if args.expert_groups is None else (args.expert_groups,)


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
    from moe_lightning.hrm.layercost import MTBENCH_PROMPT_LEN, MTBENCH_PROMPT_STD, Workload
    from moe_lightning.hrm.optimizer import optimize
    from moe_lightning.spec import ModelSpec

    if args.arch is not None:
        if args.arch not in ARCHS:
            raise ValueError(f"unknown --arch {args.arch!r}; choose one of {', '.join(ARCHS)}")
        spec, name = ARCHS[args.arch], args.arch
    else:
        spec, name = ModelSpec.from_pretrained(args.model), str(args.model)
    std = args.prompt_std if args.prompt_std is not None else args.prompt_len * MTBENCH_PROMPT_STD / MTBENCH_PROMPT_LEN
    work = Workload(args.prompt_len, args.gen_len, std)
    if args.compare_paper:
        return _compare_paper(args, spec, name, work)
    if args.compare_quantize:
        return _compare(args, spec, name, work)
    quant = resolve_expert_scheme(spec, args.model, args.quantize, args.quantize_group_size, args.gpus)
    hw = _profile(args, spec, quant)
    dtype, kv_dtype = _dtypes(args, spec, hw)
    est = optimize(
        spec, work, hw, dtype, kv_dtype=kv_dtype, quant=quant, kv_rule=args.kv_rule, expert_groups=_groups(args)
    )
    kv = host_kv(spec, work, hw, dtype, kv_dtype, quant=quant, kv_rule=args.kv_rule)
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
        quant = resolve_expert_scheme(spec, None, fmt, compared_group_size(fmt, args.quantize_group_size), args.gpus)
        hw = _profile(args, spec, quant)
        dtype, kv_dtype = _dtypes(args, spec, hw)
        est = optimize(
            spec, work, hw, dtype, kv_dtype=kv_dtype, quant=quant, kv_rule=args.kv_rule, expert_groups=_groups(args)
        )
        plans.append((quant, hw, est))
    if args.json:
        out = {"model": name, "plans": [plan_to_dict(name, spec, work, hw, est) for _, hw, est in plans]}
        sys.stdout.write(json.dumps(out) + "\n")
        return 0
    hw = plans[0][1]
    lines = [
        f"{name} on {hw.name}: prompt {work.prompt_len:g} tokens, {work.gen_len} generated, KV by {args.kv_rule} use",
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


PAPER_MACHINES = ("t4", "l4")  # the paper's single-GPU machines (design.md)
PAPER_GEN_LENS = (32, 64, 128, 256)
PAPER_KV_FORMAT = "int8"  # ours: 8-bit KV (with its scales, kv_format.py)


def _compare_paper(args: argparse.Namespace, spec: ModelSpec, name: str, work: Workload) -> int:
    """The paper's schedule (KV in the 16-bit weights' dtype, every sequence at its maximum context,
    alternating steps, experts once per micro-batch) and ours (8-bit KV, expected use, mixed steps,
    expert groups as --expert-groups): the best plan of each, per machine and generation length, by
    predicted decode tokens/s and by generated tokens over the whole job's time (hrm/schedule_cost.py)."""
    from dataclasses import replace

    from moe_lightning.hrm.layercost import EXPECTED_USE, MAX_CONTEXT
    from moe_lightning.hrm.optimizer import optimize
    from moe_lightning.hrm.schedule_cost import schedule_throughput

    quant = resolve_expert_scheme(spec, args.model, args.quantize, args.quantize_group_size, args.gpus)
    rows = []
    for machine in PAPER_MACHINES:
        hw = _profile(argparse.Namespace(**{**vars(args), "hardware": machine}), spec, quant)
        dtype, _ = _dtypes(argparse.Namespace(**{**vars(args), "kv_dtype": "auto"}), spec, hw)
        ours_kv = PAPER_KV_FORMAT if args.kv_dtype == "auto" else args.kv_dtype
        for gen in PAPER_GEN_LENS:
            w = replace(work, gen_len=gen)
            paper = optimize(spec, w, hw, dtype, kv_dtype=dtype, quant=quant, kv_rule=MAX_CONTEXT, expert_groups=(0,))
            ours = optimize(
                spec, w, hw, dtype, kv_dtype=ours_kv, quant=quant, kv_rule=EXPECTED_USE, expert_groups=_groups(args)
            )
            paper_job = schedule_throughput(spec, w, paper).alternating  # the paper's metric, its schedule
            ours_job = schedule_throughput(spec, w, ours).mixed
            rows.append((hw, gen, paper, ours, paper_job, ours_job))
    if args.json:
        out = {
            "model": name,
            "prompt_len": work.prompt_len,
            "prompt_std": work.prompt_std,
            "rows": [
                {
                    "hardware": hw.name,
                    "gen_len": gen,
                    "paper": {
                        "kv_format": paper.kv_format,
                        "kv_rule": paper.kv_rule,
                        "batch_size": paper.policy.batch,
                        "micro_batch_size": paper.policy.micro_batch_size,
                        "expert_groups": paper.policy.expert_groups,
                        "step_schedule": "alternating",
                        "predicted_decode_tokens_per_second": paper.tokens_per_second,
                        "with_prefill_tokens_per_second": paper_job,
                    },
                    "ours": {
                        "kv_format": ours.kv_format,
                        "kv_rule": ours.kv_rule,
                        "batch_size": ours.policy.batch,
                        "micro_batch_size": ours.policy.micro_batch_size,
                        "expert_groups": ours.policy.expert_groups,
                        "step_schedule": "mixed",
                        "predicted_decode_tokens_per_second": ours.tokens_per_second,
                        "with_prefill_tokens_per_second": ours_job,
                    },
                    "ratio": ours.tokens_per_second / paper.tokens_per_second,
                    "ratio_with_prefill": ours_job / paper_job,
                }
                for hw, gen, paper, ours, paper_job, ours_job in rows
            ],
        }
        sys.stdout.write(json.dumps(out) + "\n")
        return 0
    paper_kv, ours_kv = rows[0][2].kv_format, rows[0][3].kv_format
    lines = [
        f"{name}: prompts {work.prompt_len:g} +- {work.prompt_std:g} tokens; predicted decode tokens/s (tok/s) and "
        "generated tokens over a long job's time, prefill included (job/s)",
        f"paper: KV in {paper_kv} at the maximum context (s + n), alternating steps, experts once per micro-batch; "
        f"ours: KV in {ours_kv} by expected use (s + n/2 plus headroom), mixed steps, expert groups g as planned",
        f"{'GPU':<10} {'gen':>4}  {'paper N = n_ub x mu':>20} {'tok/s':>7} {'job/s':>7}  "
        f"{'ours N = n_ub x mu':>20} {'g':>2} {'tok/s':>7} {'job/s':>7} {'ratio':>6} {'job':>6}",
    ]
    for hw, gen, paper, ours, paper_job, ours_job in rows:
        pp, op = paper.policy, ours.policy
        lines.append(
            f"{hw.name:<10} {gen:>4}  {f'{pp.batch} = {pp.num_micro_batches} x {pp.micro_batch_size}':>20} "
            f"{paper.tokens_per_second:7.1f} {paper_job:7.1f}  "
            f"{f'{op.batch} = {op.num_micro_batches} x {op.micro_batch_size}':>20} {op.expert_groups:>2} "
            f"{ours.tokens_per_second:7.1f} {ours_job:7.1f} {ours.tokens_per_second / paper.tokens_per_second:5.2f}x "
            f"{ours_job / paper_job:5.2f}x"
        )
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
