"""One run of `bench`: a batch through a fresh stack, what it measured, and the file its numbers go to
after every run (a run cut short by a deadline keeps the runs before it)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from moe_lightning.commands.bench_formats import kernels_chosen
from moe_lightning.commands.bench_ranks import rank_shares
from moe_lightning.config.units import DeviceShare

STEP_KINDS = ("prefill", "decode", "mixed")


def bench_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """The workload's token ids: `--num-prompts` MT-Bench-shaped prompts (seeded), or a file's rows."""
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


def micro_batches(sequences: int, micro_batch_size: int) -> int:
    """How many micro-batches the scheduler makes of a decode batch (0: one for the whole batch)."""
    return -(-sequences // micro_batch_size) if micro_batch_size else 1


class Results(dict[str, Any]):
    """The bench's numbers, written to --json-out after every run (atomically: a reader never sees half
    a file), so a run stopped by a deadline keeps every run before it."""

    def __init__(self, path: Path | None, **fields: Any) -> None:
        super().__init__(fields)
        self.path = path

    def save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self, indent=2))
        tmp.replace(self.path)


def in_force(after: dict[str, float], policy: dict[str, str]) -> dict[str, Any]:
    """The scheduling configuration the run had, from the orchestrator's gauges (an operator's fixed
    value, else the planner's): what a prediction for the run must assume too."""
    schedule = next((k for k in after if k.startswith("moe_lightning_step_schedule_info{")), "")
    return {
        "step_schedule": schedule.split('schedule="', 1)[1].split('"', 1)[0] if schedule else None,
        "batch": int(after.get("moe_lightning_max_batch_size", 0)),
        "micro_batch_size": int(after.get("moe_lightning_micro_batch_size", 0)),
        "expert_groups": int(after.get("moe_lightning_expert_groups", 0)),
        "prefill_budget": int(after.get("moe_lightning_prefill_budget_tokens", 0)),
        "attention": policy.get("attention"),
        "experts": policy.get("experts"),
    }


def one_run(
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
    step_schedule: str | None = None,
    group_size: int | str | None = "",
) -> dict[str, Any]:
    """One batch through a fresh stack; `device_memory=""` and `group_size=""` mean the bench's flags;
    `micro_batch`: fixed for this run (default: --micro-batch-size, else the stack's planner's);
    `step_schedule`: default --step-schedule. Keys starting with "_" stay out of the JSON."""
    from moe_lightning.benchmark import decode_totals, run_batch
    from moe_lightning.timeline import load, summarize

    files = [trace_dir / f"gpu-{tag}.jsonl", trace_dir / f"cpu-{tag}.jsonl"]
    gpu = ["--timeline", str(files[0]), *([] if overlap else ["--no-overlap"])]
    gpu += ["--count-syncs"] if args.count_syncs else []
    gpu += ["--cap-device-memory"] if args.cap_device_memory else []
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
        step_schedule=step_schedule or args.step_schedule,
        prefill_budget=args.prefill_budget,
        expert_groups=args.expert_groups,
    )
    d = run.delta
    steps = {k: d("orchestrator", f'moe_lightning_step_seconds_count{{kind="{k}"}}') for k in STEP_KINDS}
    all_steps = sum(steps.values())
    generated = sum(c.completion_tokens for c in run.done)
    decode = decode_totals(run)
    events = load(files)
    policy = run.policy()
    # host synchronisations, counted by gpu_expert with --count-syncs (on CUDA its own, elsewhere the
    # reads that would be one there: services/gpu_expert/sync_count.py)
    syncs = {k: d("gpu_expert", f'moe_lightning_host_syncs_total{{kind="{k}"}}') for k in steps}
    per_step = {k: syncs[k] / steps[k] for k in steps if steps[k]}
    return {
        "generated_tokens_per_second": generated / run.wall_seconds,
        # decode rows over the time charged to them, in every step kind (a mixed step's at its decode share)
        "decode_tokens_per_second": decode.tokens_per_second,
        "decode": {"tokens": decode.tokens, "seconds": decode.seconds, "by_kind": decode.by_kind},
        "seconds": run.wall_seconds,
        "steps": steps,
        "decode_steps": decode.steps,
        "policy": policy,
        "in_force": in_force(run.after["orchestrator"], policy),
        # the operator's size when fixed: the policy gauge shows the planner's, which is then not in force
        "micro_batches": micro_batches(
            len(prompts), micro_batch or args.micro_batch_size or int(policy.get("micro_batch_size") or 0)
        ),
        "host_syncs_per_step": per_step if args.count_syncs else None,
        "host_syncs_per_decode_step": per_step.get("decode") if args.count_syncs else None,
        "pinned_host_bytes": run.after["gpu_expert"].get("moe_lightning_pinned_host_bytes", 0.0),
        "residency_changes": d("gpu_expert", "moe_lightning_residency_changes_total"),
        "resident_experts": run.after["gpu_expert"].get("moe_lightning_resident_experts", 0.0),
        "expert_bytes_streamed": d("gpu_expert", "moe_lightning_expert_bytes_streamed_total"),
        "expert_bytes_per_step": d("gpu_expert", "moe_lightning_expert_bytes_streamed_total") / max(1.0, all_steps),
        "kernels": kernels_chosen(run.after["gpu_expert"]),
        "dense_kernels": kernels_chosen(run.after["gpu_expert"], "dense"),
        "rank_shares": rank_shares(run.after["gpu_expert"], lambda key: d("gpu_expert", key), all_steps),
        "decode_stage_seconds": decode.seconds_by_stage(),
        "_decode": decode,
        "timeline": summarize(events),
        "_events": events,
    }


def layer_error_of(decode: Any, predicted: Any, layers: int) -> float | None:
    """measured / predicted - 1 of a decode step's time per layer (None without decode steps)."""
    from moe_lightning.hrm import stage_accuracy

    rows = stage_accuracy.compare(predicted, decode.timings, decode.steps, layers)
    return rows["layer"].measured / rows["layer"].predicted - 1 if rows and rows["layer"].predicted else None


def public(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if not k.startswith("_")}
