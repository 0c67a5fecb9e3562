"""What each phase's subprocess runs (`gpu_check.py _build|_bench|_offload ...`)."""

from __future__ import annotations

import argparse
import functools
import json
import signal
import time
from pathlib import Path

import torch

from bench.gpucheck import log
from bench.gpucheck.offload import transformers_offload_generate
from bench.gpucheck.workload import bench_prompts, prompts_digest
from moe_lightning.spec import ModelSpec


def _build_main(argv: list[str]) -> int:
    from moe_lightning.demo_model import write_demo_model

    p = argparse.ArgumentParser(prog="gpu_check.py _build")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--preset", required=True, help="a preset name or a JSON object of config overrides")
    p.add_argument("--dtype", required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    preset = json.loads(a.preset) if a.preset.startswith("{") else a.preset
    stamp = json.dumps({"preset": preset, "dtype": a.dtype, "seed": a.seed, "device": a.device}, sort_keys=True)
    marker = a.out / "gpu_check.built"
    if marker.is_file() and marker.read_text() == stamp:
        log(f"reusing {a.out}")
        return 0
    marker.unlink(missing_ok=True)
    t0 = time.perf_counter()
    write_demo_model(a.out, preset, seed=a.seed, dtype=a.dtype, progress=False, with_tokenizer=False, device=a.device)
    marker.write_text(stamp)  # last: a build cut short is never reused
    log(f"wrote {a.out} in {time.perf_counter() - t0:.1f} s")
    return 0


def _bench_flags() -> set[str]:
    from moe_lightning.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices["bench"]._option_string_actions)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # run_batch's `finally` then stops the stack's services in order


def _bench_main(argv: list[str]) -> int:
    """`moe-lightning bench BENCH_ARGS` with gpu_expert on `--device` and the arena in `--dtype`.

    Passed as flags when bench takes them; until then set where run_batch builds the stack's config
    (bench does not pass them, so its stack would run on the CPU in fp32)."""
    import moe_lightning.benchmark as benchmark
    from moe_lightning.cli import main as cli_main

    split = argv.index("--")
    p = argparse.ArgumentParser(prog="gpu_check.py _bench")
    p.add_argument("--device", required=True)
    p.add_argument("--dtype", required=True)
    a = p.parse_args(argv[:split])
    bench_argv = argv[split + 1 :]
    accepted, forced = _bench_flags(), {}
    for flag, value in (("--device", a.device), ("--dtype", a.dtype)):
        if flag in accepted:
            bench_argv += [flag, value]
        else:
            forced[flag.removeprefix("--")] = value
    if forced:
        log(f"bench has no flag for {sorted(forced)}: setting them in run_batch's StackConfig")
        benchmark.StackConfig = functools.partial(benchmark.StackConfig, **forced)  # type: ignore[misc]
    # A process started in the background may inherit SIGINT ignored; the parent stops us with it.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    return cli_main(["bench", *bench_argv])


def _offload_main(argv: list[str]) -> int:
    started = time.perf_counter()
    p = argparse.ArgumentParser(prog="gpu_check.py _offload")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--max-memory", type=int, required=True, help="accelerate's weight placement on GPU 0")
    p.add_argument("--total-memory", type=int, default=None, help="everything it allocates on GPU 0")
    p.add_argument("--num-prompts", type=int, required=True)
    p.add_argument("--gen-len", type=int, required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--seconds", type=float, default=float("inf"), help="start no chunk that would end later")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--start-batch", type=int, default=None, help="the batch to try first (halved on OOM)")
    a = p.parse_args(argv)
    spec = ModelSpec.from_pretrained(a.model)
    prompts = bench_prompts(a.model, spec.vocab_size, a.num_prompts)
    result = transformers_offload_generate(
        a.model,
        prompts,
        a.gen_len,
        a.max_memory,
        getattr(torch, a.dtype),
        total_memory_bytes=a.total_memory,
        deadline=started + a.seconds,
        start_batch=a.start_batch,
    )
    result["prompts_sha256"] = prompts_digest(prompts)
    a.json.write_text(json.dumps(result, indent=2))
    log(
        f"offload: {result['generated_tokens_per_second']:.1f} tok/s at batch {result['batch_size']}"
        f" ({result['prompts_run']} of {len(prompts)} prompts run)"
    )
    return 0


WORKERS = {"_build": _build_main, "_bench": _bench_main, "_offload": _offload_main}
