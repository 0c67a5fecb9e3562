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
import sys
import tempfile
from pathlib import Path
from typing import Any

from moe_lightning.commands.bench_formats import compare_formats, device_memory_for
from moe_lightning.commands.bench_ranks import report as ranks_report
from moe_lightning.commands.bench_runs import Results, bench_prompts, layer_error_of, micro_batches, one_run, public
from moe_lightning.config import flags
from moe_lightning.config.checks import compared_group_size, link_flag_error
from moe_lightning.config.units import format_rate, positive_int
from moe_lightning.quant.scheme import QuantFormat


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help="throughput vs transformers, vs our own overlap-off schedule, vs the roofline")
    flags.MODEL.add_to(p, required=True)
    p.add_argument("--workload", default="mtbench", help="mtbench (synthetic lengths) or a prompts .parquet/.jsonl")
    p.add_argument(
        "--num-prompts",
        type=positive_int,
        default=32,
        help="prompts in the batch (mtbench); any number: the API takes them in calls of at most 1,024",
    )
    flags.GEN_LEN.add_to(p, default=32)
    flags.DEVICE.add_to(p, default="cpu")  # gpu_expert's (and transformers')
    flags.GPUS.add_to(p, default=1)  # prints each rank's bytes streamed and time in collectives
    flags.DTYPE.add_to(p, default="auto")
    flags.DEVICE_MEMORY.add_to(p)  # a share (25%) is of each run's own format
    flags.CAP_DEVICE_MEMORY.add_to(p, default=False)  # gpu_expert's whole allocation within --device-memory (bytes)
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
    flags.STEP_SCHEDULE.add_to(p, default="mixed")  # ours and (b); (d) runs alternating steps
    flags.PREFILL_BUDGET.add_to(p)  # default: the HRM's
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
    p.add_argument(
        "--json-out", type=Path, default=None, help="write all numbers here as JSON (rewritten after every run)"
    )
    p.add_argument("--trace", type=Path, default=None, help="write our run's Chrome trace here")
    flags.PNG.add_to(p)


Row = tuple[str, dict[str, Any], str, float | None]  # (name, run, what the ratio is, its target)


def run(args: argparse.Namespace) -> int:
    from moe_lightning.spec import ModelSpec, resolve_dtype

    error = link_flag_error(args.device, args.link_bandwidth)
    if error:
        raise ValueError(error)
    spec = ModelSpec.from_pretrained(args.model)
    args.dtype = resolve_dtype(args.dtype, spec.dtype, args.device)  # every run and baseline uses this one
    prompts = bench_prompts(args, spec.vocab_size)
    n = len(prompts)
    if args.micro_batches is not None:
        if not 1 <= args.micro_batches <= n:
            raise ValueError(f"--micro-batches must be in 1..{n} (the prompts in the batch), got {args.micro_batches}")
        args.micro_batch_size = -(-n // args.micro_batches)
        sys.stderr.write(
            f"{micro_batches(n, args.micro_batch_size)} micro-batches of at most {args.micro_batch_size} sequences\n"
        )
    avg = sum(map(len, prompts)) / n
    sys.stderr.write(
        f"{n} prompts (average {avg:.0f}, longest {max(map(len, prompts))} tokens), {args.gen_len} generated each\n"
    )
    if args.compare_quantize is None:  # a share of the weights: of this stack's arena
        args.device_memory = device_memory_for(args.device_memory, args.model, spec, args.dtype, None, None, args.gpus)
    trace_dir = Path(tempfile.mkdtemp(prefix="moe-lightning-bench-"))
    asked = {"step_schedule": args.step_schedule, "prefill_budget": args.prefill_budget}
    asked |= {"expert_groups": args.expert_groups, "micro_batch_size": args.micro_batch_size}
    results = Results(args.json_out, prompts=n, average_prompt_tokens=avg, gen_len=args.gen_len, asked=asked)
    if args.compare_quantize is not None:  # the formats against each other, nothing else
        _formats(args, spec, prompts, trace_dir, results)
        return 0
    ours, rows, runs = _runs(args, spec, prompts, trace_dir, results)
    _roofline(args, spec, prompts, ours, runs, results)
    _print(args, spec, ours, rows, results)
    results.save()
    return 0


def _formats(args: argparse.Namespace, spec: Any, prompts: list[list[int]], trace_dir: Path, results: Results) -> None:
    formats = [QuantFormat(f) for f in args.compare_quantize]
    # both placements unless one is asked for: streamed (the bytes bind) and in place (the kernels do)
    placements = ["gpu", "cpu"] if args.experts_placement == "auto" else [args.experts_placement]
    for placement in placements:

        def one(fmt: Any, placement: str = placement) -> dict[str, Any]:
            group_size = compared_group_size(fmt.value, args.quantize_group_size)
            memory = device_memory_for(args.device_memory, args.model, spec, args.dtype, fmt, group_size, args.gpus)
            tag = f"{fmt.value}{placement}"
            run = one_run(
                args,
                prompts,
                tag,
                trace_dir,
                device_memory=memory,
                experts=placement,
                quantize=fmt.value,
                group_size=group_size,
            )
            return {**public(run), "device_memory": memory}

        key = "formats" if placement == "gpu" else "formats_in_place"
        results[key] = compare_formats(formats, one, placement)
        results.save()


def _runs(
    args: argparse.Namespace, spec: Any, prompts: list[list[int]], trace_dir: Path, results: Results
) -> tuple[dict[str, Any], list[Row], dict[str, dict[str, Any]]]:
    """ours, then the reference and baseline runs asked for, each saved the moment it ends."""
    sys.stderr.write("ours (overlap on)...\n")
    ours = one_run(args, prompts, "1", trace_dir)
    if args.trace is not None:
        from moe_lightning.timeline import write

        write(ours["_events"], chrome_path=args.trace)
    if args.png is not None:
        from moe_lightning.timeline_plot import plot_timeline

        plot_timeline(ours["_events"], args.png, f"ours: {args.model.name}, {len(prompts)} prompts")
    policy = ours["policy"]
    results["ours"] = public(ours)
    results.save()
    rows: list[Row] = []
    runs: dict[str, dict[str, Any]] = {}

    def add(key: str, name: str, run: dict[str, Any], what: str, target: float | None) -> None:
        runs[key] = run
        results[key] = public(run)
        rows.append((name, results[key], what, target))
        results.save()

    att, exp = policy.get("attention"), policy.get("experts")
    # ours' micro-batch for the baselines: their own planners would re-plan it (where the link binds, sizes
    # tie for a pipeline that (b) does not run), and the schedule is what the comparisons are about
    mu = args.micro_batch_size or int(policy.get("micro_batch_size") or 0) or None
    if args.device_memory and not args.skip_references:
        sys.stderr.write("reference: ours with the whole model resident...\n")
        add(
            "resident",
            "ours, whole model resident",
            one_run(args, prompts, "r", trace_dir, device_memory=None),
            "ours / it",
            0.85,
        )
        if ours["resident_experts"] < spec.total_experts:  # the other expert placement
            other = "gpu" if exp == "cpu" else "cpu"
            key, name = ("streamed", "experts streamed (copy)") if other == "gpu" else ("in_place", "experts in place")
            sys.stderr.write(f"ours with the {name}...\n")
            add(key, f"ours, {name}", one_run(args, prompts, "c", trace_dir, experts=other), "it / resident", None)
    if not args.skip_overlap_off:
        sys.stderr.write("baseline (b): ours with overlap off, same placement...\n")
        off = one_run(args, prompts, "0", trace_dir, False, attention=att, experts=exp, micro_batch=mu)
        add("overlap_off", "(b) overlap off", off, "ours / it", 1.2)
    if "streamed" in results and not args.skip_overlap_off:  # ours in place: compare the streaming schedules too
        sys.stderr.write("baseline (b) at the streamed placement...\n")
        off = one_run(args, prompts, "s", trace_dir, False, attention=att, experts="gpu")
        add("overlap_off_streamed", "(b) overlap off, experts streamed", off, "streamed / it", 1.2)
    if not args.skip_alternating:
        sys.stderr.write("baseline (d): ours with alternating steps, same placement and micro-batch...\n")
        alt = one_run(
            args, prompts, "a", trace_dir, attention=att, experts=exp, micro_batch=mu, step_schedule="alternating"
        )
        add("alternating", "(d) alternating steps", alt, "ours / it", None)
    if not args.skip_transformers:
        sys.stderr.write("baseline (a): transformers generate...\n")
        from moe_lightning.benchmark import transformers_generate

        results["transformers"] = transformers_generate(args.model, prompts, args.gen_len, args.device, args.dtype)
        rows.append(("(a) transformers generate", results["transformers"], "ours / it", 3.0))
        results.save()
    return ours, rows, runs


def _roofline(
    args: argparse.Namespace,
    spec: Any,
    prompts: list[list[int]],
    ours: dict[str, Any],
    runs: dict[str, dict[str, Any]],
    results: Results,
) -> None:
    """(c): the HRM's decode bound at the policy that ran, and its layer time against each run's."""
    from moe_lightning.benchmark import policy_that_ran
    from moe_lightning.hrm import stage_accuracy
    from moe_lightning.hrm.calibrate import cached_profile
    from moe_lightning.hrm.costmodel import estimate
    from moe_lightning.hrm.hardware import with_simulated_link
    from moe_lightning.hrm.layercost import Workload
    from moe_lightning.quant.resolve import resolve_scheme

    n = len(prompts)
    quant = resolve_scheme(args.model)  # the checkpoint's own format: what this bench's stack ran
    profile = cached_profile(spec, args.device, quant=quant).with_gpus(args.gpus)
    if args.link_bandwidth is not None:  # the link the stack ran behind, as its planner saw it
        profile = with_simulated_link(profile, args.link_bandwidth)
        results["link_bandwidth"] = args.link_bandwidth
    policy = ours["policy"]
    ran = policy_that_ran(policy, ours["resident_experts"], _decode_batch(ours, n), args.micro_batch_size)
    kv_dtype = args.dtype if args.kv_dtype == "auto" else args.kv_dtype
    work = Workload(results["average_prompt_tokens"], args.gen_len)
    bound = estimate(spec, work, profile, ran, args.dtype, kv_dtype=kv_dtype, quant=quant)
    results["roofline_decode_tokens_per_second"] = bound.tokens_per_second
    results["roofline_policy"] = str(ran)
    layer_error = {"ours": layer_error_of(ours["_decode"], bound, spec.num_layers)}
    # (b)'s own prediction: the same roofs, every resource's time added; (d)'s: ours' (the same decode steps)
    for key, overlap in (("overlap_off", False), ("alternating", True)):
        if key in runs:
            r = runs[key]
            mu = args.micro_batch_size or int(policy.get("micro_batch_size") or 0) or None
            its = policy_that_ran(r["policy"], r["resident_experts"], _decode_batch(r, n), mu)
            est = estimate(spec, work, profile, its, args.dtype, kv_dtype=kv_dtype, quant=quant, overlap=overlap)
            results[f"roofline_{key}_decode_tokens_per_second"] = est.tokens_per_second
            layer_error[key] = layer_error_of(r["_decode"], est, spec.num_layers)
    results["hrm_layer_error"] = layer_error  # measured / predicted - 1, per layer of a decode step
    dec = ours["_decode"]
    results["_stages"] = stage_accuracy.compare(bound, dec.timings, dec.steps, spec.num_layers)
    results["stages_per_layer"] = stage_accuracy.as_json(results["_stages"])
    results["_bound"] = bound


def _decode_batch(run: dict[str, Any], n: int) -> int:
    """The rows a run's steps decoded on average: the batch its decode time is predicted at. All n where
    every decode step is whole (alternating steps); fewer while admission spans mixed steps, whose
    decode batches grow as prompts come in (a link-bound pass costs the same whatever its rows)."""
    d = run["_decode"]
    return max(1, min(n, round(d.tokens / d.steps))) if d.steps else n


def _print(args: argparse.Namespace, spec: Any, ours: dict[str, Any], rows: list[Row], results: Results) -> None:
    """The table: ours, each baseline and its ratio, decode against decode, the HRM's rows."""
    from moe_lightning.hrm import stage_accuracy

    bound, stages = results.pop("_bound"), results.pop("_stages")
    e2e = ours["generated_tokens_per_second"]
    print(f"policy that ran: {results['roofline_policy']}")
    print(f"{'':34} {'tok/s':>8} {'ratio':>20} {'target':>7}")
    print(f"{'ours, end to end':34} {e2e:8.1f}")
    print(f"{'ours, decode':34} {ours['decode_tokens_per_second']:8.1f}")
    ratios = results.setdefault("ratios", {})
    for name, r, what, target in rows:
        t = r["generated_tokens_per_second"]
        if what.startswith("it"):
            ratio = t / results["resident"]["generated_tokens_per_second"]
        elif what.startswith("streamed"):
            ratio = results["streamed"]["generated_tokens_per_second"] / t
        else:
            ratio = e2e / t
        ratios[name] = ratio
        print(f"{name:34} {t:8.1f} {ratio:6.2f} {what:>13} {'>= ' + str(target) if target else '':>7}")
    for key, name in (("overlap_off", "(b) overlap off, decode"), ("alternating", "(d) alternating steps, decode")):
        other = results.get(key)
        if other and other["decode_tokens_per_second"]:
            # decode alone: where the link binds; prefill on a CPU device is compute-bound in both schedules
            t = other["decode_tokens_per_second"]
            ratios[name] = ours["decode_tokens_per_second"] / t
            print(f"{name:34} {t:8.1f} {ratios[name]:6.2f} {'ours / it':>13}")
    decode_ratio = ours["decode_tokens_per_second"] / bound.tokens_per_second
    ratios["decode / roofline"] = decode_ratio
    name = "(c) HRM roofline bound, decode"
    print(f"{name:34} {bound.tokens_per_second:8.1f} {decode_ratio:6.2f} {'of it':>13} {'>= 0.6':>7}")
    link = f", behind a simulated {format_rate(args.link_bandwidth)} link" if args.link_bandwidth else ""
    print(f"HRM predicted vs measured, ms per layer of a decode step ({spec.num_layers} layers, ours{link}):")
    print("\n".join(stage_accuracy.table(stages)))
    print(
        "HRM layer time, measured / predicted - 1: "
        + ", ".join(f"{run} {e:+.0%}" for run, e in results["hrm_layer_error"].items() if e is not None)
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
