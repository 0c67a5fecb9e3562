"""GPU check for issue 5: our stack against its own overlap-off schedule and against transformers with
accelerate offloading, on a Mixtral-8x7B-shaped checkpoint cut to 4 layers (bf16, ~12 GB, random
weights from a fixed seed), within a device budget that holds the dense weights, the streaming ring
and about 20 % of the expert weights. Targets (issue 5): ours >= 3x (b) overlap off, >= 10x offload.

Run it on the H200 machine through bench/gpu_check.sh (it installs the wheels the image lacks). Every
phase but the checks is a subprocess with its own timeout under one deadline (default 440 s):

  checks     GPU, versions, imports, room in /dev/shm (the weight arena lives there) and on disk
  preflight  the same bench on a 4-layer toy model, same device, dtype and budget rule, so start-up,
             CUDA and dtype faults show in seconds (runs while the checkpoint is being built)
  build      the checkpoint, generated on the GPU and saved with safetensors (reused when present)
  ours       `moe-lightning bench`: ours, then (b) ours with overlap off, on the MT-Bench workload
  offload    transformers generate with accelerate offloading in the same budget, same prompts

The report (JSON) is rewritten after every phase, so a phase that times out leaves the others' numbers.

    python bench/gpu_check.py [--num-prompts 64] [--gen-len 32] [--json gpu_check.json]
    python bench/gpu_check.py --dry-run     # the whole flow on the toy model on the CPU (seconds)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.gpucheck import log  # noqa: E402
from bench.gpucheck.budget import Budget, describe_budget, device_budget, layers_that_fit, shm_needed  # noqa: E402
from bench.gpucheck.environment import environment  # noqa: E402
from bench.gpucheck.formats import run_formats  # noqa: E402
from bench.gpucheck.parallel import run_tensor_parallel  # noqa: E402
from bench.gpucheck.preflight import CUDA_TESTS, PREFLIGHT_KV, preflight_facts, preflight_sizes  # noqa: E402
from bench.gpucheck.processes import Phase, PhaseRunner  # noqa: E402
from bench.gpucheck.workers import WORKERS  # noqa: E402
from bench.gpucheck.workload import bench_prompts, prompts_digest  # noqa: E402
from moe_lightning.demo_model import PRESETS, mixtral_config  # noqa: E402
from moe_lightning.flags import format_size  # noqa: E402
from moe_lightning.spec import ModelSpec  # noqa: E402

PRESET = "mixtral-8x7b-4l"
# The toy for the preflight and --dry-run: the real model's layer and expert counts (so the budget
# rule gives the same residency plan), tiny widths.
TOY = {**PRESETS["tiny"], "num_hidden_layers": 4, "num_local_experts": 8}
TARGETS = {"ours_over_overlap_off": 3.0, "ours_over_offload": 10.0}


class GpuCheck(PhaseRunner):
    # ---- phases ----------------------------------------------------------------------------------
    def build(self, out: Path, preset: str | dict[str, Any], timeout: float) -> Phase | None:
        """The checkpoint in bf16 (Mixtral's own dtype), generated on the device under test."""
        text = preset if isinstance(preset, str) else json.dumps(preset)
        argv = [__file__, "_build", "--out", str(out), "--preset", text, "--dtype", "bfloat16"]
        return self.start(
            f"build-{out.name}", [*argv, "--device", self.args.device, "--seed", str(self.args.seed)], timeout
        )

    def bench(
        self,
        name: str,
        model: Path,
        budget: Budget,
        dtype: str,
        prompts: int,
        gen_len: int,
        timeout: float,
        fail_fast: bool = False,
        extra: tuple[str, ...] = (),
    ) -> dict[str, Any] | None:
        """`moe-lightning bench` with gpu_expert on the device and the arena in `dtype`; its JSON.
        `extra`: more bench flags (they replace the defaults below where both are given)."""
        result = self.json_path.parent / f"gpu_check-{name}.json"
        result.unlink(missing_ok=True)
        args = [
            "--model",
            str(model),
            "--workload",
            "mtbench",
            "--num-prompts",
            str(prompts),
            "--gen-len",
            str(gen_len),
        ]
        args += ["--device-memory", str(budget.device_memory), "--json", str(result)]
        args += ["--trace", str(self.json_path.parent / f"gpu_check-{name}-trace.json")]
        args += [] if self.args.with_transformers else ["--skip-transformers"]
        # the reference runs (whole model resident, experts computed on the host in bf16 on the CPU)
        # would not fit the time budget; ours vs (b) and vs offload are what the check is for
        args += ["--skip-references"]
        # the paper's configuration: non-resident experts stream to the GPU (CGOPipe is what is checked)
        args += ["--experts-placement", "gpu"]
        if not any(f in extra for f in ("--micro-batches", "--micro-batch-size")):
            args += ["--micro-batch-size", str(self.args.micro_batch_size)] if self.args.micro_batch_size else []
            args += ["--micro-batches", str(self.args.micro_batches)] if self.args.micro_batches else []
        args += list(extra)
        device = ["--device", self.args.device, "--dtype", dtype]
        command = " ".join(["moe-lightning", "bench", *args])
        self.record(name, command=f"{command}  # gpu_expert --device {self.args.device}, weight_store --dtype {dtype}")
        phase = self.start(name, [__file__, "_bench", *device, "--", *args], timeout, stack=True, fail_fast=fail_fast)
        ok = self.finish(phase)
        return json.loads(result.read_text()) if ok and result.is_file() else None

    def check_room(self, what: str, path: str, need: int) -> str | None:
        free = shutil.disk_usage(path).free
        log(f"{what}: {format_size(free)} free at {path}, {format_size(need)} needed")
        return None if free >= need else f"{path} has {format_size(free)} free; {what} needs {format_size(need)}"

    def run(self) -> int:
        a = self.args
        self.work.mkdir(parents=True, exist_ok=True)
        env = self.report["environment"] = environment()
        self.save()
        if env["import_errors"]:
            return self.fail(
                "imports failed: " + "; ".join(env["import_errors"]) + ". Fetch the missing wheels on the dev "
                "machine (bash ../shared/gpu-check/wheels.sh posix-ipc grpcio protobuf [more]) and carry .whl"
            )
        if a.device == "cuda" and not torch.cuda.is_available():
            return self.fail("no CUDA device (--dry-run runs the flow on the CPU)")

        preset: str | dict[str, Any] = TOY if a.dry_run else PRESET
        if not a.dry_run:
            layers = layers_that_fit(PRESETS[PRESET], a.dtype, a.resident_fraction, shutil.disk_usage("/dev/shm").free)
            if layers < PRESETS[PRESET]["num_hidden_layers"]:
                preset = {**PRESETS[PRESET], "num_hidden_layers": max(1, layers)}
                log(f"/dev/shm holds a {layers}-layer model, not {PRESETS[PRESET]['num_hidden_layers']}: using that")
                self.report["shm_layers"] = layers
        config = mixtral_config(preset, "bfloat16")
        spec = ModelSpec.from_hf_config(config)
        model_dir = self.work / ("toy" if a.dry_run else f"{PRESET}-{spec.num_layers}l")
        checkpoint_bytes = 2 * spec.num_parameters()
        self.report["model"] = {
            "preset": "toy" if a.dry_run else f"{PRESET}, {spec.num_layers} layers",
            "dir": str(model_dir),
            "config": config,
            "parameters": spec.num_parameters(),
            "checkpoint_bytes": checkpoint_bytes,
            "seed": a.seed,
        }
        budget = device_budget(spec, a.dtype, a.resident_fraction)
        offload_budget = device_budget(spec, "bfloat16", a.resident_fraction)  # the checkpoint's dtype
        log(f"budget, ours ({a.dtype}): {describe_budget(budget)}")
        self.report["budget"] = {
            "rule": f"smallest budget at which gpu_expert's plan keeps >= {a.resident_fraction:.0%} of the experts",
            "ours": {"dtype": a.dtype, **asdict(budget), "human": format_size(budget.device_memory)},
            "offload": {
                "dtype": "bfloat16",
                **asdict(offload_budget),
                "human": format_size(offload_budget.device_memory),
            },
        }
        problem = self.check_room("the weight arena + KV cache", "/dev/shm", shm_needed(spec, budget))
        if problem:
            return self.fail(
                f"{problem}. The weight store keeps its arena in /dev/shm: give the container more "
                "(docker run --shm-size=32g, or mount -o remount,size=32G /dev/shm)"
            )
        if not (model_dir / "gpu_check.built").is_file():
            problem = self.check_room("the checkpoint", str(self.work), checkpoint_bytes + (1 << 30))
            if problem:
                return self.fail(f"{problem}; point --work-dir at a larger disk")
        prompts = bench_prompts(model_dir, spec.vocab_size, a.num_prompts)
        lengths = [len(p) for p in prompts]
        self.report["workload"] = {
            "kind": "mtbench",
            "prompts": len(prompts),
            "gen_len": a.gen_len,
            "average_prompt_tokens": sum(lengths) / len(lengths),
            "longest_prompt_tokens": max(lengths),
            "prompts_sha256": prompts_digest(prompts),
        }
        self.save()

        # the checkpoint is built while the preflight looks for faults of the stack on this machine
        builder = self.build(model_dir, preset, self.timeout(180, 240))
        self.cuda_tests()
        dtype = self.preflight() if a.preflight else a.dtype
        built = self.finish(builder)
        bench = None
        if not built:
            self.report["ours_error"] = "no checkpoint: see phases.build-*"
        elif dtype is None:
            self.report["ours_error"] = "the preflight failed: see phases.preflight-* and gpu_check-logs/"
        else:
            if dtype != a.dtype:
                budget = device_budget(spec, dtype, a.resident_fraction)
                self.report["budget"]["ours"] = {
                    "dtype": dtype,
                    **asdict(budget),
                    "human": format_size(budget.device_memory),
                }
                log(f"budget, ours ({dtype}): {describe_budget(budget)}")
                problem = self.check_room("the weight arena + KV cache", "/dev/shm", shm_needed(spec, budget))
                self.report["ours_error"] = problem
            if not self.report.get("ours_error"):
                bench = self.bench("ours", model_dir, budget, dtype, a.num_prompts, a.gen_len, self.timeout(300, 100))
        self.report["ours_bench"] = bench

        offload = None
        if built and not a.skip_offload:
            result = self.json_path.parent / "gpu_check-offload.json"
            result.unlink(missing_ok=True)
            argv = [__file__, "_offload", "--model", str(model_dir), "--max-memory", str(offload_budget.device_memory)]
            argv += ["--num-prompts", str(a.num_prompts), "--gen-len", str(a.gen_len), "--json", str(result)]
            argv += ["--dtype", "float32" if a.dry_run else "bfloat16"]  # bf16 matmul is emulated on small CPUs
            if self.finish(self.start("offload", argv, self.timeout(240, 0))) and result.is_file():
                offload = json.loads(result.read_text())
                offload["same_prompts"] = offload.pop("prompts_sha256") == self.report["workload"]["prompts_sha256"]
        self.report["offload"] = offload
        if built and dtype is not None and a.dry_run:  # the preflight's formats ran this flow on a toy alike
            self.record("formats", ok=True, skipped="dry run: preflight-formats ran the same flow")
        elif built and dtype is not None:  # last: the formats, on the checkpoint, in what time is left
            run_formats(self, "formats", model_dir, budget, dtype, a.num_prompts, a.gen_len, self.timeout(240, 0), 128)
        return self.conclude(bench, offload)

    def preflight(self) -> str | None:
        """The bench on the toy model, through the paths a first GPU run breaks; returns the dtype our
        stack works in on this machine, or None.

        Two runs per dtype: attention on the host with 8 micro-batches (the pinned, asynchronous
        hand-offs; more micro-batches than channel slots), hot-expert residency every 2 decode steps
        and the host synchronisations counted; then attention on the device over its own KV cache.
        When the requested dtype fails the fallback is tried, so one fault (say, a dtype mismatch
        between the device and the attention service) still leaves numbers to read, marked as such."""
        a = self.args
        toy_dir = self.work / "preflight"
        if not self.finish(self.build(toy_dir, TOY, self.timeout(60, 300))):
            return None
        toy = ModelSpec.from_hf_config(mixtral_config(TOY, "bfloat16"))
        n, gen = preflight_sizes(a.dry_run)
        for dtype in [a.dtype] + ([a.fallback_dtype] if a.fallback_dtype not in ("none", a.dtype) else []):
            budget = device_budget(toy, dtype, a.resident_fraction)
            # ours only: its baseline (b) runs in the `ours` phase; here it would cost device time for nothing
            skip = ("--skip-references", "--skip-overlap-off")
            pipeline = ("--micro-batches", "8", "--residency-interval", "2", "--count-syncs", *skip)
            name = f"preflight-{dtype}"
            result = self.bench(name, toy_dir, budget, dtype, n, gen, self.timeout(120, 240), True, pipeline)
            if result is None:
                continue
            self.report.setdefault("preflight", {})[name] = preflight_facts(result)
            on_device = replace(budget, device_memory=budget.device_memory + PREFLIGHT_KV)
            attention = ("--micro-batches", "8", "--attention-placement", "gpu", *skip)
            attention += ("--device-kv-memory", str(PREFLIGHT_KV))
            name = f"preflight-device-attention-{dtype}"
            result = self.bench(name, toy_dir, on_device, dtype, n, gen, self.timeout(120, 240), True, attention)
            self.report["preflight"][name] = preflight_facts(result) if result else {"ok": False}
            formats = f"preflight-formats-{dtype}"
            run_formats(self, formats, toy_dir, budget, dtype, n, gen, self.timeout(150, 240), group_size=32)
            ranks = f"preflight-tensor-parallel-{dtype}"
            run_tensor_parallel(self, ranks, toy_dir, budget, dtype, n, gen, self.timeout(120, 240))
            if dtype != a.dtype:
                self.report["dtype_fallback"] = f"our stack failed in {a.dtype} on the toy model; ours ran in {dtype}"
                log(f"WARNING: {self.report['dtype_fallback']}")
            return dtype
        return None

    def cuda_tests(self) -> None:
        """The unit tests that need a GPU (the copy engine, the CUDA hand-off path, sync counts),
        when pytest is importable (bash ../shared/gpu-check/wheels.sh ... pytest pluggy iniconfig)."""
        if importlib.util.find_spec("pytest") is None:
            self.record("cuda-tests", ok=False, skipped="pytest is not installed (fetch its wheels, see gpu_check.sh)")
            return
        # a dry run only collects them: without a GPU their CUDA cases skip, and the suite runs the others
        only = ["--collect-only"] if self.args.dry_run else []
        argv = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *CUDA_TESTS, *only]
        self.finish(self.start("cuda-tests", argv, self.timeout(150, 200)))

    def fail(self, message: str) -> int:
        log(f"FAILED: {message}")
        self.report["status"] = "failed"
        self.report["error"] = message
        self.save()
        print(json.dumps(self.report, indent=2, default=str))
        return 2

    def conclude(self, bench: dict[str, Any] | None, offload: dict[str, Any] | None) -> int:
        ratios: dict[str, Any] = {}
        if bench is not None:
            ours = bench["ours"]["generated_tokens_per_second"]
            ratios["ours_over_overlap_off"] = ours / bench["overlap_off"]["generated_tokens_per_second"]
            if offload is not None:
                ratios["ours_over_offload"] = ours / offload["generated_tokens_per_second"]
        self.report["ratios"] = {
            name: {"value": value, "target": TARGETS[name], "met": value >= TARGETS[name]}
            for name, value in ratios.items()
        }
        complete = len(ratios) == len(TARGETS)
        self.report["status"] = "ok" if complete else "partial"
        self.save()
        print(json.dumps(self.report, indent=2, default=str))

        def row(label: str, result: dict[str, Any] | None, note: str) -> str:
            tps = f"{result['generated_tokens_per_second']:10.1f}" if result else f"{'-':>10}"
            return f"{label:28} {tps}  {note}".rstrip()

        budget = self.report["budget"]["ours"]
        lines = [
            f"budget {budget['human']}: {budget['resident_experts']} of {budget['total_experts']} experts resident;"
            f" ours in {budget['dtype']}",
            *([f"WARNING: {self.report['dtype_fallback']}"] if "dtype_fallback" in self.report else []),
            f"{'':28} {'tok/s':>10}",
        ]
        if bench is not None:
            lines.append(row("ours", bench["ours"], f"(decode {bench['ours']['decode_tokens_per_second']:.1f})"))
            lines.append(row("(b) ours, overlap off", bench["overlap_off"], ""))
            if "transformers" in bench:
                lines.append(row("(a) transformers, CPU fp32", bench["transformers"], ""))
        else:
            lines.append(row("ours", None, f"({self.report.get('ours_error') or 'see phases.ours'})"))
        note = f"(batch {offload['batch_size']})" if offload else "(see phases.offload)"
        lines.append(row("accelerate offload", offload, note))
        lines += [
            f"ours / {name.removeprefix('ours_over_')}: {r['value']:.2f} (target >= {r['target']:g}: "
            f"{'met' if r['met'] else 'NOT met'})"
            for name, r in self.report["ratios"].items()
        ]
        log("summary (also in " + str(self.json_path) + "):\n" + "\n".join(lines))
        return 0 if complete else 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=None, help="batch for every system (default 64; dry run 4)")
    p.add_argument("--gen-len", type=int, default=None, help="tokens generated per prompt (default 32; dry run 4)")
    p.add_argument(
        "--resident-fraction", type=float, default=0.2, help="share of the experts the budget keeps resident"
    )
    p.add_argument("--dtype", default=None, help="our arena's dtype (default bfloat16; dry run float32)")
    p.add_argument("--fallback-dtype", default="float32", help="dtype to try when the preflight fails ('none': off)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: the HRM's policy")
    p.add_argument("--micro-batches", type=int, default=None, help="force this many micro-batches (n_ub)")
    p.add_argument("--seed", type=int, default=0, help="the checkpoint's weights")
    p.add_argument(
        "--work-dir",
        default=None,
        help="checkpoints, arena copy, logs (default: a new private directory under the temp dir; a given "
        "one is created 0700 and refused if another user could write to it)",
    )
    p.add_argument("--json", type=Path, default=Path("gpu_check.json"), help="the report (logs go next to it)")
    p.add_argument("--deadline", type=float, default=440.0, help="seconds for everything; phases share them")
    p.add_argument(
        "--preflight",
        choices=["auto", "on", "off"],
        default="auto",
        help="toy-model runs first (auto: on; in a dry run they exercise the same paths on the CPU)",
    )
    p.add_argument("--skip-offload", action="store_true", help="leave out the accelerate offload baseline")
    p.add_argument("--with-transformers", action="store_true", help="also bench's baseline (a) (CPU, fp32: slow)")
    p.add_argument("--dry-run", action="store_true", help="the toy model on the CPU: checks the flow, not speed")
    a = p.parse_args(argv)
    a.device = "cpu" if a.dry_run else "cuda"
    a.num_prompts = a.num_prompts or (4 if a.dry_run else 64)
    a.gen_len = a.gen_len or (4 if a.dry_run else 32)
    a.dtype = a.dtype or ("float32" if a.dry_run else "bfloat16")
    a.preflight = a.preflight in ("on", "auto")
    return a


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in WORKERS:
        return WORKERS[argv[0]](argv[1:])
    check = GpuCheck(parse_args(argv))
    check.json_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return check.run()
    except KeyboardInterrupt:  # the outer timeout in gpu_check.sh: stop the phases, keep what was measured
        log("interrupted: stopping the running phases")
        check.stop_all()
        check.report["status"] = "interrupted"
        check.save()
        return 130


if __name__ == "__main__":
    sys.exit(main())
