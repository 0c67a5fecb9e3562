"""bench: our stack on an MT-Bench-shaped (or given) workload against its baselines, in one run.

(a) transformers' generate on the same checkpoint and batch (padding as it needs); (b) our services
with overlap off (each stage waits for the previous, experts copied when needed); (c) the HRM's
roofline bound for this machine at the policy that ran. Ratios, not absolute times, are the result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help="throughput vs transformers, vs our own overlap-off schedule, vs the roofline")
    p.add_argument("--model", required=True, type=Path, help="HF checkpoint directory")
    p.add_argument("--workload", default="mtbench", help="mtbench (synthetic lengths) or a prompts .parquet/.jsonl")
    p.add_argument("--num-prompts", type=int, default=32, help="prompts in the batch (mtbench)")
    p.add_argument("--gen-len", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--device-memory", default=None, help="gpu_expert's budget, e.g. 25%% of the weights: 800MiB")
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: the HRM's policy")
    p.add_argument("--skip-transformers", action="store_true", help="leave out baseline (a)")
    p.add_argument("--json", type=Path, default=None, help="write all numbers here")
    p.add_argument("--trace", type=Path, default=None, help="write our run's Chrome trace here")


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


def _ours(args: argparse.Namespace, prompts: list[list[int]], overlap: bool, trace_dir: Path) -> dict[str, Any]:
    from moe_lightning.benchmark import run_batch
    from moe_lightning.timeline import load, summarize

    files = [trace_dir / f"gpu-{overlap}.jsonl", trace_dir / f"cpu-{overlap}.jsonl"]
    extra = {
        "gpu_expert": ["--timeline", str(files[0]), *([] if overlap else ["--no-overlap"])],
        "cpu_attention": ["--timeline", str(files[1])],
    }
    run = run_batch(
        args.model,
        prompts,
        args.gen_len,
        f"bench{os.getpid()}{int(overlap)}",
        extra=extra,
        device_memory=args.device_memory,
        micro_batch=args.micro_batch_size,
    )
    d = run.delta
    generated = sum(c.completion_tokens for c in run.done)
    decode_s = d("orchestrator", 'moe_lightning_step_seconds_sum{kind="decode"}')
    events = load(files)
    return {
        "generated_tokens_per_second": generated / run.wall_seconds,
        "decode_tokens_per_second": (generated - len(run.done)) / decode_s if decode_s else 0.0,
        "seconds": run.wall_seconds,
        "decode_steps": d("orchestrator", 'moe_lightning_step_seconds_count{kind="decode"}'),
        "timeline": summarize(events),
        "_events": events,
    }


def run(args: argparse.Namespace) -> int:
    from moe_lightning.hrm.calibrate import cached_profile
    from moe_lightning.hrm.costmodel import Policy, Workload, estimate
    from moe_lightning.spec import ModelSpec
    from moe_lightning.timeline import write

    spec = ModelSpec.from_pretrained(args.model)
    prompts = _prompts(args, spec.vocab_size)
    n = len(prompts)
    avg = sum(map(len, prompts)) / n
    sys.stderr.write(
        f"{n} prompts (average {avg:.0f}, longest {max(map(len, prompts))} tokens), {args.gen_len} generated each\n"
    )
    trace_dir = Path(tempfile.mkdtemp(prefix="moe-lightning-bench-"))
    results: dict[str, Any] = {"prompts": n, "average_prompt_tokens": avg, "gen_len": args.gen_len}
    sys.stderr.write("ours (overlap on)...\n")
    ours = _ours(args, prompts, True, trace_dir)
    if args.trace is not None:
        write(ours["_events"], chrome_path=args.trace)
    sys.stderr.write("baseline (b): ours with overlap off...\n")
    seq = _ours(args, prompts, False, trace_dir)
    results["ours"] = {k: v for k, v in ours.items() if not k.startswith("_")}
    results["overlap_off"] = {k: v for k, v in seq.items() if not k.startswith("_")}
    if not args.skip_transformers:
        sys.stderr.write("baseline (a): transformers generate...\n")
        from moe_lightning.benchmark import transformers_generate

        results["transformers"] = transformers_generate(args.model, prompts, args.gen_len)
    profile = cached_profile(spec, "cpu")
    mu = args.micro_batch_size or n
    bound = estimate(spec, Workload(avg, args.gen_len), profile, Policy(-(-n // mu) * mu, mu), "float32")
    results["roofline_decode_tokens_per_second"] = bound.tokens_per_second

    e2e = ours["generated_tokens_per_second"]
    print(f"{'':34} {'tok/s':>10} {'ratio (ours / it)':>18}")
    print(f"{'ours, end to end':34} {e2e:10.1f}")
    print(f"{'ours, decode':34} {ours['decode_tokens_per_second']:10.1f}")
    print(
        f"{'(b) overlap off, end to end':34} {seq['generated_tokens_per_second']:10.1f} "
        f"{e2e / seq['generated_tokens_per_second']:18.2f}"
    )
    if "transformers" in results:
        t = results["transformers"]["generated_tokens_per_second"]
        print(f"{'(a) transformers generate':34} {t:10.1f} {e2e / t:18.2f}")
    print(
        f"{'(c) HRM roofline bound, decode':34} {bound.tokens_per_second:10.1f} "
        f"{ours['decode_tokens_per_second'] / bound.tokens_per_second:18.2f}"
    )
    tl = ours["timeline"]
    print(
        "busy fraction "
        + ", ".join(f"{r} {v:.0%}" for r, v in sorted(tl["busy_fraction"].items()))
        + "; hidden behind another resource "
        + ", ".join(f"{r} {v:.0%}" for r, v in sorted(tl["hidden_fraction"].items()))
    )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0
