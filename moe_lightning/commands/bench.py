"""bench: our stack on an MT-Bench-shaped (or given) workload against its baselines, in one run.

(a) transformers' generate on the same checkpoint and batch (padding as it needs); (b) our services
with overlap off (each stage waits for the previous, experts copied when needed); (c) the HRM's
roofline bound for this machine at the policy that ran; (d) our services with the paper's alternating
steps (a step prefills or decodes, never both). Ratios, not absolute times, are the result. One batch,
all admitted at once, gives mixed steps little to do: bench/step_schedules.py measures them under
continuous admission (docs/cgopipe-and-benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from moe_lightning.commands.bench_formats import compare_formats, device_memory_for, kernels_chosen
from moe_lightning.commands.bench_ranks import rank_shares
from moe_lightning.commands.bench_ranks import report as ranks_report
from moe_lightning.config import flags
from moe_lightning.config.checks import compared_group_size, link_flag_error
from moe_lightning.config.units import DeviceShare, format_rate
from moe_lightning.quant.scheme import QuantFormat


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help="throughput vs transformers, vs our own overlap-off schedule, vs the roofline")
    flags.MODEL.add_to(p, required=True)
    p.add_argument("--workload", default="mtbench", help="mtbench (synthetic lengths) or a prompts .parquet/.jsonl")
    p.add_argument("--num-prompts", type=int, default=32, help="prompts in the batch (mtbench)")
    flags.GEN_LEN.add_to(p, default=32)
    flags.DEVICE.add_to(p, default="cpu")  # gpu_expert's (and transformers')
    flags.GPUS.add_to(p, default=1)  # prints each rank's bytes streamed and time in collectives
    flags.DTYPE.add_to(p, default="auto")
    flags.DEVICE_MEMORY.add_to(p)  # a share (25%) is of each run's own format
    flags.KV_DTYPE.add_to(p, default="auto")
    flags.DEVICE_KV_MEMORY.add_to(p)
    flags.ATTENTION_PLACEMENT.add_to(p, default="auto")
    flags.EXPERTS_PLACEMENT.add_to(p, default="auto")
    flags.LINK_BANDWIDTH.add_to(p)
    flags.COMPARE_QUANTIZE.add_to(p)  # the formats against each other instead, each streaming at --device-memory
    flags.QUANTIZE_GROUP_SIZE.add_to(p)
    sizes = p.add_mutually_exclusive_group()
    flags.MICRO_BATCH_SIZE.add_to(sizes)
    sizes.add_argument(
        "--micro-batches", type=int, default=None, help="force this many micro-batches (n_ub) for the batch"
    )
    flags.EXPERT_GROUPS.add_to(p)  # default: the HRM's (every run of the bench alike)
    flags.RESIDENCY_INTERVAL.add_to(p)  # default: gpu_expert's own
    flags.COUNT_SYNCS.add_to(p, default=False)
    p.add_argument("--skip-transformers", action="store_true", help="leave out baseline (a)")
    p.add_argument("--skip-alternating", action="store_true", help="leave out baseline (d), alternating steps")
    p.add_argument(
        "--skip-overlap-off",
        action="store_true",
        help="leave out baseline (b): a run that only needs ours (the GPU check's preflight)",
    )
    p.add_argument(
        "--skip-references",
        action="store_true",
        help="leave out the reference runs (whole model resident; the other expert placement and its (b))",
    )
    p.add_argument("--json-out", type=Path, default=None, help="write all numbers here as JSON")
    p.add_argument("--trace", type=Path, default=None, help="write our run's Chrome trace here")
    flags.PNG.add_to(p)


def _prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    import torch

    from moe_lightning.benchmark import mtbench_lengths

    if args.workload == "mtbench":
        g = torch.Generator().manual_seed(1)
        return [
            [1, *torch.randint(3, vocab, (n - 1,), generator=g).tolist()] for n in mtbench_lengths(args.num_prompts)
        ]
    from moe_lightning.commands.run_job import read_prompts
    from moe_lightning.tokenizer import TextTokenizer

    rows = read_prompts(Path(args.workload)).to_pylist()
    tok = TextTokenizer.from_model_dir(args.model)
    out = []
    for r in rows:
        if r.get("prompt_ids") is not None:
            out.append([int(t) for t in r["prompt_ids"]])
        elif tok is not None:
            out.append(tok.encode(r["prompt"]))
        else:
            raise ValueError(f"{args.model} has no tokenizer.json: the workload needs prompt_ids")
    return out


def _micro_batches(sequences: int, micro_batch_size: int) -> int:
    """How many micro-batches the scheduler makes of a decode batch (0: one for the whole batch)."""
    return -(-sequences // micro_batch_size) if micro_batch_size else 1


def _ours(
    args: argparse.Namespace,
    prompts: list[list[int]],
    tag: str,
    trace_dir: Path,
    overlap: bool = True,
    device_memory: int | DeviceShare | str | None = "",
    attention: str | None = None,
    experts: str | None = None,
    quantize: str = "auto",
    micro_batch: int | None = None,
    step_schedule: str = "mixed",
    group_size: int | str | None = "",
) -> dict[str, Any]:
    """One batch through a fresh stack; `device_memory=""` and `group_size=""` mean the bench's flags;
    `micro_batch`: fixed for this run (default: --micro-batch-size, else the stack's planner's)."""
    from moe_lightning.benchmark import decode_totals, run_batch
    from moe_lightning.timeline import load, summarize

    files = [trace_dir / f"gpu-{tag}.jsonl", trace_dir / f"cpu-{tag}.jsonl"]
    gpu = ["--timeline", str(files[0]), *([] if overlap else ["--no-overlap"])]
    gpu += ["--count-syncs"] if args.count_syncs else []
    gpu += ["--residency-interval", str(args.residency_interval)] if args.residency_interval is not None else []
    extra = {"gpu_expert": gpu, "cpu_attention": ["--timeline", str(files[1])]}
    run = run_batch(
        args.model,
        prompts,
        args.gen_len,
        f"bench{os.getpid()}{tag}",
        extra=extra,
        device_memory=args.device_memory if device_memory == "" else device_memory,
        micro_batch=micro_batch or args.micro_batch_size,
        device=args.device,
        gpus=args.gpus,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        device_kv_memory=args.device_kv_memory,
        link_bandwidth=args.link_bandwidth,
        attention_placement=attention or args.attention_placement,
        experts_placement=experts or args.experts_placement,
        quantize=quantize,
        quantize_group_size=args.quantize_group_size if group_size == "" else group_size,
        step_schedule=step_schedule,
        expert_groups=args.expert_groups,
    )
    d = run.delta
    all_steps = sum(
        d("orchestrator", f'moe_lightning_step_seconds_count{{kind="{k}"}}') for k in ("prefill", "decode", "mixed")
    )
    generated = sum(c.completion_tokens for c in run.done)
    decode = decode_totals(run)
    decode_s = d("orchestrator", 'moe_lightning_step_seconds_sum{kind="decode"}')
    events = load(files)
    policy = run.policy()
    steps = decode.steps
    syncs = d("gpu_expert", 'moe_lightning_cuda_syncs_total{kind="decode"}')
    counted = args.count_syncs and args.device.startswith("cuda")  # gpu_expert counts only on CUDA
    return {
        "generated_tokens_per_second": generated / run.wall_seconds,
        "decode_tokens_per_second": (generated - len(run.done)) / decode_s if decode_s else 0.0,
        "seconds": run.wall_seconds,
        "decode_steps": decode.steps,
        "policy": policy,
        # the operator's size when fixed: the policy gauge shows the planner's, which is then not in force
        "micro_batches": _micro_batches(
            len(prompts), micro_batch or args.micro_batch_size or int(policy.get("micro_batch_size") or 0)
        ),
        "cuda_syncs_per_decode_step": syncs / steps if counted and steps else None,
        "pinned_host_bytes": run.after["gpu_expert"].get("moe_lightning_pinned_host_bytes", 0.0),
        "residency_changes": d("gpu_expert", "moe_lightning_residency_changes_total"),
        "resident_experts": run.after["gpu_expert"].get("moe_lightning_resident_experts", 0.0),
        "expert_bytes_streamed": d("gpu_expert", "moe_lightning_expert_bytes_streamed_total"),
        "expert_bytes_per_step": d("gpu_expert", "moe_lightning_expert_bytes_streamed_total") / max(1.0, all_steps),
        "kernels": kernels_chosen(run.after["gpu_expert"]),
        "dense_kernels": kernels_chosen(run.after["gpu_expert"], "dense"),
        "rank_shares": rank_shares(run.after["gpu_expert"], lambda key: d("gpu_expert", key), all_steps),
        "decode_stage_seconds": decode.seconds(),
        "_decode": decode,
        "timeline": summarize(events),
        "_events": events,
    }


def layer_error_of(decode: Any, predicted: Any, layers: int) -> float | None:
    """measured / predicted - 1 of a decode step's time per layer (None without decode steps)."""
    from moe_lightning.hrm import stage_accuracy

    rows = stage_accuracy.compare(predicted, decode.timings, decode.steps, layers)
    return rows["layer"].measured / rows["layer"].predicted - 1 if rows and rows["layer"].predicted else None


def _public(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if not k.startswith("_")}


def run(args: argparse.Namespace) -> int:
    from moe_lightning.benchmark import policy_that_ran
    from moe_lightning.hrm import stage_accuracy
    from moe_lightning.hrm.calibrate import cached_profile
    from moe_lightning.hrm.costmodel import estimate
    from moe_lightning.hrm.hardware import with_simulated_link
    from moe_lightning.hrm.layercost import Workload
    from moe_lightning.spec import ModelSpec, resolve_dtype
    from moe_lightning.timeline import write

    error = link_flag_error(args.device, args.link_bandwidth)
    if error:
        raise ValueError(error)
    spec = ModelSpec.from_pretrained(args.model)
    args.dtype = resolve_dtype(args.dtype, spec.dtype, args.device)  # every run and baseline uses this one
    prompts = _prompts(args, spec.vocab_size)
    n = len(prompts)
    if args.micro_batches is not None:
        if not 1 <= args.micro_batches <= n:
            raise ValueError(f"--micro-batches must be in 1..{n} (the prompts in the batch), got {args.micro_batches}")
        args.micro_batch_size = -(-n // args.micro_batches)
        sys.stderr.write(
            f"{_micro_batches(n, args.micro_batch_size)} micro-batches of at most {args.micro_batch_size} sequences\n"
        )
    avg = sum(map(len, prompts)) / n
    sys.stderr.write(
        f"{n} prompts (average {avg:.0f}, longest {max(map(len, prompts))} tokens), {args.gen_len} generated each\n"
    )
    if args.compare_quantize is None:  # a share of the weights: of this stack's arena
        args.device_memory = device_memory_for(args.device_memory, args.model, spec, args.dtype, None, None, args.gpus)
    trace_dir = Path(tempfile.mkdtemp(prefix="moe-lightning-bench-"))
    results: dict[str, Any] = {"prompts": n, "average_prompt_tokens": avg, "gen_len": args.gen_len}
    if args.compare_quantize is not None:  # the formats against each other, nothing else
        formats = [QuantFormat(f) for f in args.compare_quantize]

        # both placements unless one is asked for: streamed (the bytes bind) and in place (the kernels do)
        placements = ["gpu", "cpu"] if args.experts_placement == "auto" else [args.experts_placement]
        for placement in placements:

            def one(fmt: Any, placement: str = placement) -> dict[str, Any]:
                group_size = compared_group_size(fmt.value, args.quantize_group_size)
                memory = device_memory_for(args.device_memory, args.model, spec, args.dtype, fmt, group_size, args.gpus)
                tag = f"{fmt.value}{placement}"
                run = _ours(
                    args,
                    prompts,
                    tag,
                    trace_dir,
                    device_memory=memory,
                    experts=placement,
                    quantize=fmt.value,
                    group_size=group_size,
                )
                return {**_public(run), "device_memory": memory}

            key = "formats" if placement == "gpu" else "formats_in_place"
            results[key] = compare_formats(formats, one, placement)
        if args.json_out is not None:
            args.json_out.write_text(json.dumps(results, indent=2))
        return 0
    sys.stderr.write("ours (overlap on)...\n")
    ours = _ours(args, prompts, "1", trace_dir)
    if args.trace is not None:
        write(ours["_events"], chrome_path=args.trace)
    if args.png is not None:
        from moe_lightning.timeline_plot import plot_timeline

        plot_timeline(ours["_events"], args.png, f"ours: {args.model.name}, {n} prompts")
    policy = ours["policy"]
    results["ours"] = _public(ours)
    rows: list[tuple[str, dict[str, Any], str, float | None]] = []  # (name, run, what the ratio is, target)
    if args.device_memory and not args.skip_references:
        sys.stderr.write("reference: ours with the whole model resident...\n")
        results["resident"] = _public(_ours(args, prompts, "r", trace_dir, device_memory=None))
        rows.append(("ours, whole model resident", results["resident"], "ours / it", 0.85))
        if ours["resident_experts"] < spec.total_experts:  # the other expert placement
            other = "gpu" if policy.get("experts") == "cpu" else "cpu"
            key, name = ("streamed", "experts streamed (copy)") if other == "gpu" else ("in_place", "experts in place")
            sys.stderr.write(f"ours with the {name}...\n")
            results[key] = _public(_ours(args, prompts, "c", trace_dir, experts=other))
            rows.append((f"ours, {name}", results[key], "it / resident", None))
    overlap_off, mu = None, None  # (b)'s run, and the micro-batch it ran at
    if not args.skip_overlap_off:
        sys.stderr.write("baseline (b): ours with overlap off, same placement...\n")
        att, exp = policy.get("attention"), policy.get("experts")
        # ours' micro-batch too: (b)'s own planner would re-plan it (where the link binds, sizes tie for
        # a pipeline that (b) does not run), and the schedule is what the comparison is about
        mu = args.micro_batch_size or int(policy.get("micro_batch_size") or 0) or None
        overlap_off = _ours(args, prompts, "0", trace_dir, False, attention=att, experts=exp, micro_batch=mu)
        results["overlap_off"] = _public(overlap_off)
        rows.append(("(b) overlap off", results["overlap_off"], "ours / it", 1.2))
    if "streamed" in results and not args.skip_overlap_off:  # ours in place: compare the streaming schedules too
        sys.stderr.write("baseline (b) at the streamed placement...\n")
        att = policy.get("attention")
        results["overlap_off_streamed"] = _public(
            _ours(args, prompts, "s", trace_dir, False, attention=att, experts="gpu")
        )
        rows.append(("(b) overlap off, experts streamed", results["overlap_off_streamed"], "streamed / it", 1.2))
    if not args.skip_alternating:
        sys.stderr.write("baseline (d): ours with alternating steps, same placement and micro-batch...\n")
        att, exp = policy.get("attention"), policy.get("experts")
        mu_d = args.micro_batch_size or int(policy.get("micro_batch_size") or 0) or None
        alternating = _ours(
            args, prompts, "a", trace_dir, attention=att, experts=exp, micro_batch=mu_d, step_schedule="alternating"
        )
        results["alternating"] = _public(alternating)
        rows.append(("(d) alternating steps", results["alternating"], "ours / it", None))
    if not args.skip_transformers:
        sys.stderr.write("baseline (a): transformers generate...\n")
        from moe_lightning.benchmark import transformers_generate

        results["transformers"] = transformers_generate(args.model, prompts, args.gen_len, args.device, args.dtype)
        rows.append(("(a) transformers generate", results["transformers"], "ours / it", 3.0))
    from moe_lightning.quant.resolve import resolve_scheme

    quant = resolve_scheme(args.model)  # the checkpoint's own format: what this bench's stack ran
    profile = cached_profile(spec, args.device, quant=quant).with_gpus(args.gpus)
    if args.link_bandwidth is not None:  # the link the stack ran behind, as its planner saw it
        profile = with_simulated_link(profile, args.link_bandwidth)
        results["link_bandwidth"] = args.link_bandwidth
    ran = policy_that_ran(policy, ours["resident_experts"], n, args.micro_batch_size)
    kv_dtype = args.dtype if args.kv_dtype == "auto" else args.kv_dtype
    work = Workload(avg, args.gen_len)
    bound = estimate(spec, work, profile, ran, args.dtype, kv_dtype=kv_dtype, quant=quant)
    results["roofline_decode_tokens_per_second"] = bound.tokens_per_second
    results["roofline_policy"] = str(ran)
    layer_error = {"ours": layer_error_of(ours["_decode"], bound, spec.num_layers)}
    if overlap_off is not None:  # (b)'s own prediction: the same roofs, every resource's time added
        off = policy_that_ran(overlap_off["policy"], overlap_off["resident_experts"], n, mu)
        off_bound = estimate(spec, work, profile, off, args.dtype, kv_dtype=kv_dtype, quant=quant, overlap=False)
        results["roofline_overlap_off_decode_tokens_per_second"] = off_bound.tokens_per_second
        layer_error["overlap_off"] = layer_error_of(overlap_off["_decode"], off_bound, spec.num_layers)
    results["hrm_layer_error"] = layer_error  # measured / predicted - 1, per layer of a decode step

    e2e = ours["generated_tokens_per_second"]
    print(f"policy that ran: {ran}")
    print(f"{'':34} {'tok/s':>8} {'ratio':>20} {'target':>7}")
    print(f"{'ours, end to end':34} {e2e:8.1f}")
    print(f"{'ours, decode':34} {ours['decode_tokens_per_second']:8.1f}")
    for name, r, what, target in rows:
        t = r["generated_tokens_per_second"]
        if what.startswith("it"):
            ratio = t / results["resident"]["generated_tokens_per_second"]
        elif what.startswith("streamed"):
            ratio = results["streamed"]["generated_tokens_per_second"] / t
        else:
            ratio = e2e / t
        results.setdefault("ratios", {})[name] = ratio
        print(f"{name:34} {t:8.1f} {ratio:6.2f} {what:>13} {'>= ' + str(target) if target else '':>7}")
    if overlap_off is not None and overlap_off["decode_tokens_per_second"]:
        # decode alone: where the link binds; prefill on a CPU device is compute-bound in both schedules
        t = overlap_off["decode_tokens_per_second"]
        ratio = ours["decode_tokens_per_second"] / t
        results.setdefault("ratios", {})["(b) overlap off, decode"] = ratio
        print(f"{'(b) overlap off, decode':34} {t:8.1f} {ratio:6.2f} {'ours / it':>13}")
    decode_ratio = ours["decode_tokens_per_second"] / bound.tokens_per_second
    results.setdefault("ratios", {})["decode / roofline"] = decode_ratio
    name = "(c) HRM roofline bound, decode"
    print(f"{name:34} {bound.tokens_per_second:8.1f} {decode_ratio:6.2f} {'of it':>13} {'>= 0.6':>7}")
    dec = ours["_decode"]
    stages = stage_accuracy.compare(bound, dec.timings, dec.steps, spec.num_layers)
    results["stages_per_layer"] = stage_accuracy.as_json(stages)
    link = f", behind a simulated {format_rate(args.link_bandwidth)} link" if args.link_bandwidth else ""
    print(f"HRM predicted vs measured, ms per layer of a decode step ({spec.num_layers} layers, ours{link}):")
    print("\n".join(stage_accuracy.table(stages)))
    print(
        "HRM layer time, measured / predicted - 1: "
        + ", ".join(f"{run} {e:+.0%}" for run, e in layer_error.items() if e is not None)
    )
    if args.gpus > 1:
        results["tensor_parallel"] = ranks_report(ours["rank_shares"], spec, bound, args.gpus)
    tl = ours["timeline"]
    print(
        "busy fraction "
        + ", ".join(f"{r} {v:.0%}" for r, v in sorted(tl["busy_fraction"].items()))
        + "; hidden behind another resource "
        + ", ".join(f"{r} {v:.0%}" for r, v in sorted(tl["hidden_fraction"].items()))
    )
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(results, indent=2))
    return 0
