"""GPU check (issues 5 and 26): our stack against its own overlap-off schedule (b) and against
transformers with accelerate offloading, on a Mixtral-8x7B-shaped checkpoint cut to 4 layers (bf16,
~12 GB, random weights from a fixed seed), within a device budget that holds the dense weights, the
streaming ring and about 20 % of the expert weights, at the batch the HRM picks for that link-bound
budget. Targets (issue 5): ours >= 3x (b), >= 10x offload; next to them, the HRM's prediction.

It fits a GPU lease (bench/gpu_check.sh: at most 6 minutes, two files in $OUT). The main comparison
runs first, its summary printed and written the moment it ends; then the optional phases, each
skipped (and recorded so) when the deadline leaves it too little time. Every phase is a subprocess
with its own timeout; a failed one never stops the next.

  checks     GPU, versions, imports, room in /dev/shm (the weight arena lives there) and on disk
  hrm        the HRM's pick (optimize on the h200 preset) and its prediction for ours, (b), offload
  build      the checkpoint, generated on the GPU and saved with safetensors (in the background)
  preflight  meanwhile, the bench on a toy model through 8 micro-batches, hot-expert residency and
             the counted host syncs: a start-up, CUDA or dtype fault shows in seconds (a bf16
             failure that fp32 does not share makes ours run in fp32; a failure never skips ours)
  ours       `moe-lightning bench`: ours, then (b) ours with overlap off, at the HRM's N and micro-batch
  offload    transformers generate with accelerate offloading, all of its GPU memory capped at the
             same budget, same prompts (time-capped: chunks of its largest batch)
  optional   cuda-tests (GPU unit tests), formats (bf16/int8/int4 experts), tensor-parallel (2 ranks
             on the one GPU), device-attention (attention on the device): on the toy model

Out: OUT/gpu_check.json (every figure, rewritten after every phase) and OUT/gpu_check-logs.tar.gz
(log tails, the bench JSONs, our Chrome trace); the rest stays in the private work dir.

    python bench/gpu_check.py [--batch-cap 1024] [--gen-len 32] [--out DIR]
    python bench/gpu_check.py --predict-only   # the HRM's pick and prediction, no GPU needed
    python bench/gpu_check.py --dry-run        # the whole flow on the toy model on the CPU
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(REPO))

from bench.gpucheck import log  # noqa: E402
from bench.gpucheck.args import parse_args  # noqa: E402
from bench.gpucheck.budget import Budget, describe_budget, device_budget, layers_that_fit, shm_needed  # noqa: E402
from bench.gpucheck.formats import DRY_RUN_FORMATS, FORMATS, run_formats  # noqa: E402
from bench.gpucheck.optional import OptionalPhase, run_optional  # noqa: E402
from bench.gpucheck.outputs import MAX_DEPTH, MAX_FILES, out_dir_problems, write_archive  # noqa: E402
from bench.gpucheck.parallel import run_tensor_parallel  # noqa: E402
from bench.gpucheck.predict import hrm_prediction, pinned_flags, prediction_table, profile_for  # noqa: E402
from bench.gpucheck.preflight import CUDA_TESTS, PREFLIGHT_KV, preflight_facts, preflight_sizes, run_preflight  # noqa: E402
from bench.gpucheck.processes import PhaseRunner  # noqa: E402
from bench.gpucheck.report import predicted_vs_measured, ratios, summary_lines  # noqa: E402
from moe_lightning.config.units import format_size  # noqa: E402
from moe_lightning.demo_model import PRESETS, mixtral_config  # noqa: E402
from moe_lightning.spec import ModelSpec  # noqa: E402

PRESET = "mixtral-8x7b-4l"
# The toy for the preflight, the optional phases and --dry-run: the real model's layer and expert
# counts (so the budget rule gives the same residency plan), tiny widths.
TOY = {**PRESETS["tiny"], "num_hidden_layers": 4, "num_local_experts": 8}
SCRIPT_SECONDS = 360  # the lease rule: 6 minutes of script, so a rerun fits in the 15 of a lease
FIRST_MEASUREMENT_SECONDS = 180  # ours' numbers saved by then, a kill after it still brings them back


class GpuCheck(PhaseRunner):
    def run(self) -> int:
        a = self.args
        self.report["limits"] = {
            "script_seconds": SCRIPT_SECONDS,
            "first_measurement_seconds": FIRST_MEASUREMENT_SECONDS,
            "deadline_seconds": a.deadline,
            "out_files": MAX_FILES,
            "out_depth": MAX_DEPTH,
        }
        log(f"report in {self.out / 'gpu_check.json'}, work dir {self.work}, deadline {a.deadline:.0f} s")
        from bench.gpucheck.environment import environment  # imports every service: after the limits are saved

        env = self.report["environment"] = environment()
        self.save()
        if env["import_errors"]:
            return self.fail(
                "imports failed: " + "; ".join(env["import_errors"]) + ". Fetch the missing wheels on the dev "
                "machine (bash bench/gpu_wheels.sh) and carry .whl (see bench/README.md)"
            )
        if a.device == "cuda" and not env.get("gpu"):
            return self.fail("no CUDA device (--dry-run runs the flow on the CPU)")
        ctx = self.setup()
        if isinstance(ctx, int):
            return ctx
        self.main_comparison(*ctx)
        self.conclude()  # the main comparison's summary, printed and written now
        write_archive(self.out, self.collect, self.work)
        run_optional(self, self.optional_phases(ctx[1]), a.skip)
        return self.conclude(final=True)

    # ---- setup: model, budget, the HRM's pick, room ----------------------------------------------
    def setup(self) -> tuple[ModelSpec, Path, Any, Budget] | int:
        a = self.args
        preset: str | dict[str, Any] = TOY if a.dry_run else PRESET
        spec, budget = self.plan(preset, a.dtype)
        if not a.dry_run:
            free = shutil.disk_usage("/dev/shm").free
            n = self.report["hrm"]["batch"]
            layers = layers_that_fit(PRESETS[PRESET], a.dtype, a.resident_fraction, free, n, a.gen_len)
            if layers < spec.num_layers:
                preset = {**PRESETS[PRESET], "num_hidden_layers": max(1, layers)}
                log(f"/dev/shm holds a {layers}-layer model, not {spec.num_layers}: using that")
                self.report["shm_layers"] = layers
                spec, budget = self.plan(preset, a.dtype)
        model_dir = self.work / ("toy" if a.dry_run else f"{PRESET}-{spec.num_layers}l")
        checkpoint_bytes = 2 * spec.num_parameters()
        self.report["model"] = {
            "preset": "toy" if a.dry_run else f"{PRESET}, {spec.num_layers} layers",
            "layers": spec.num_layers,
            "dir": str(model_dir),
            "config": mixtral_config(preset, "bfloat16"),
            "parameters": spec.num_parameters(),
            "checkpoint_bytes": checkpoint_bytes,
            "seed": a.seed,
        }
        n = self.report["hrm"]["batch"]
        need = shm_needed(spec, budget, n, a.gen_len, a.dtype)
        problem = self.check_room("the weight arena + KV cache", "/dev/shm", need) if self.uses_checkpoint() else None
        if problem:
            return self.fail(
                f"{problem}. The weight store keeps its arena in /dev/shm: give the container more "
                "(docker run --shm-size=32g, or mount -o remount,size=32G /dev/shm), or lower --batch-cap"
            )
        if self.uses_checkpoint() and not (model_dir / "gpu_check.built").is_file():  # it and the store's copy
            problem = self.check_room("the checkpoint", str(self.work), 2 * checkpoint_bytes + (1 << 30))
            if problem:
                return self.fail(f"{problem}; point --work-dir at a larger disk")
        self.workload(spec, n)
        return spec, model_dir, preset, budget

    def uses_checkpoint(self) -> bool:
        """Whether a phase that runs uses the big checkpoint (ours, offload, the formats on it): a rerun
        that skips them builds nothing and needs no room for it."""
        a = self.args
        return not {"ours", "offload"} <= a.skip or (a.formats_on == "checkpoint" and "formats" not in a.skip)

    def workload(self, spec: ModelSpec, n: int) -> None:
        """The prompts every system gets (bench's own mtbench prompts for N), recorded with a digest."""
        from bench.gpucheck.workload import describe_workload

        self.report["workload"] = describe_workload(self.work, spec.vocab_size, n, self.args.gen_len)
        self.save()

    def plan(self, preset: str | dict[str, Any], dtype: str) -> tuple[ModelSpec, Budget]:
        """The budget rule and the HRM's pick for this model in `dtype` (recorded in the report)."""
        a = self.args
        spec = ModelSpec.from_hf_config(mixtral_config(preset, "bfloat16"))
        # capped: the budget bounds all ours allocates on the GPU (gpu_expert --cap-device-memory), as the
        # offload baseline's total is bounded, so both hold their activations within the same bytes
        budget = device_budget(spec, dtype, a.resident_fraction, capped=True)
        log(f"budget, ours ({dtype}): {describe_budget(budget)}")
        offload = device_budget(spec, "bfloat16", a.resident_fraction, capped=True)  # the checkpoint's dtype
        self.report["budget"] = {
            "rule": f"smallest budget at which gpu_expert's plan keeps >= {a.resident_fraction:.0%} of the experts,"
            " with room for its activations: all it allocates on the GPU (--cap-device-memory)",
            "ours": {"dtype": dtype, **asdict(budget), "human": format_size(budget.device_memory)},
            "offload": {
                "dtype": "bfloat16",
                **asdict(offload),
                "human": format_size(offload.device_memory),
                # accelerate's weight placement: what ours' weights get, less the room for the layer it copies in
                "weights_bytes": offload.device_memory - offload.ring_bytes - offload.reserve_bytes,
                "total_bytes": offload.device_memory,  # everything it allocates on the GPU
            },
        }
        gpu = (self.report.get("environment") or {}).get("gpu") or {}
        profile, why = profile_for(a.profile, gpu.get("name"))
        t0 = time.monotonic()
        hrm = hrm_prediction(spec, budget, dtype, a.batch_cap, a.gen_len, profile)
        self.report["hrm"] = {**hrm, "profile_chosen": why, "table": prediction_table(hrm)}
        self.record("hrm", ok=True, seconds=round(time.monotonic() - t0, 1))
        log("\n    ".join(["the HRM's pick and prediction:", *self.report["hrm"]["table"]]))
        return spec, budget

    def check_room(self, what: str, path: str, need: int) -> str | None:
        free = shutil.disk_usage(path).free
        log(f"{what}: {format_size(free)} free at {path}, {format_size(need)} needed")
        return None if free >= need else f"{path} has {format_size(free)} free; {what} needs {format_size(need)}"

    # ---- the main comparison ---------------------------------------------------------------------
    def main_comparison(self, spec: ModelSpec, model_dir: Path, preset: Any, budget: Budget) -> None:
        a = self.args
        toy_dir = self.work / "toy"
        # the checkpoint is built while the preflight looks for faults of the stack on this machine; a
        # rerun that skips what uses it (ours, offload, formats on it) builds nothing (12 GB, ~a minute)
        uses = self.uses_checkpoint()
        builder = None if a.dry_run or not uses else self.build(model_dir, preset, self.timeout(150, 150))
        toy = self.finish(self.build(toy_dir, TOY, self.timeout(60, 200)))
        dtype = a.dtype
        if toy and a.preflight and "preflight" not in a.skip:
            dtype = run_preflight(self, toy_dir, TOY) or a.dtype  # a failed preflight never skips ours
        built = toy if a.dry_run else uses and self.finish(builder)
        if dtype != a.dtype:  # the fallback: our stack works in it on the toy model, not in a.dtype
            spec, budget = self.plan(preset, dtype)
            need = shm_needed(spec, budget, self.report["hrm"]["batch"], a.gen_len, dtype)
            if self.check_room("the weight arena + KV cache", "/dev/shm", need):
                log(f"not enough room for {dtype}: ours runs in {a.dtype} after all")
                dtype, (spec, budget) = a.dtype, self.plan(preset, a.dtype)
            self.workload(spec, self.report["hrm"]["batch"])
        hrm = self.report["hrm"]
        bench = None
        if not uses:
            for name in ("ours", "offload"):
                self.record(name, ok=None, skipped="--skip")
        elif not built:
            self.report["ours_error"] = "no checkpoint: see phases.build-*"
            for name in ("ours", "offload"):
                self.record(name, ok=None, skipped=self.report["ours_error"])
        elif "ours" in a.skip:
            self.record("ours", ok=None, skipped="--skip")
        else:
            timeout = self.timeout(240, 0 if "offload" in a.skip else 80)  # the offload phase's least
            n = hrm["batch"]
            bench = self.bench(
                "ours", model_dir, budget.device_memory, dtype, n, a.gen_len, timeout, True, pinned_flags(hrm), True
            )
        self.report["ours_bench"] = bench
        if uses and built and "offload" not in a.skip:
            self.report["offload"] = self.offload(model_dir, hrm["batch"], self.timeout(120, 5))
        self.save()

    def offload(self, model_dir: Path, n: int, timeout: float) -> dict[str, Any] | None:
        a, b = self.args, self.report["budget"]["offload"]
        result = self.collect / "offload.json"
        result.unlink(missing_ok=True)
        argv = [str(REPO / "bench" / "gpu_check.py"), "_offload", "--model", str(model_dir)]
        argv += ["--max-memory", str(b["weights_bytes"]), "--total-memory", str(b["total_bytes"])]
        argv += ["--num-prompts", str(n), "--gen-len", str(a.gen_len), "--json", str(result)]
        # its batch search starts near where the HRM's bound says it fits, one halving above it (each
        # out-of-memory attempt costs a failed prefill; from 1,024 it took five)
        argv += ["--start-batch", str(min(n, 2 * self.report["hrm"]["offload"]["batch"]))]
        # its load, out-of-memory halving and a few chunks of its batch: later chunks only repeat them
        argv += ["--seconds", str(max(10.0, min(75.0, timeout - 20)))]
        argv += ["--dtype", "float32" if a.dry_run else "bfloat16"]  # bf16 matmul is emulated on small CPUs
        if not (self.finish(self.start("offload", argv, timeout)) and result.is_file()):
            return None
        offload = json.loads(result.read_text())
        offload["same_prompts"] = offload.pop("prompts_sha256") == self.report["workload"]["prompts_sha256"]
        return offload

    # ---- the optional phases ---------------------------------------------------------------------
    def optional_phases(self, model_dir: Path) -> list[OptionalPhase]:
        a = self.args
        toy_dir = self.work / "toy"
        toy = ModelSpec.from_hf_config(mixtral_config(TOY, "bfloat16"))
        dtype = (self.report.get("budget") or {}).get("ours", {}).get("dtype", a.dtype)
        budget = device_budget(toy, dtype, a.resident_fraction)
        n, gen = preflight_sizes(a.dry_run)
        on_checkpoint = a.formats_on == "checkpoint"
        formats_model, group = (model_dir, 128) if on_checkpoint else (toy_dir, 32)  # 32: the toy's narrow widths
        formats_n = self.report["hrm"]["batch"] if on_checkpoint else n

        def formats(timeout: float) -> None:
            chosen = DRY_RUN_FORMATS if a.dry_run else FORMATS
            run_formats(self, "formats", formats_model, dtype, formats_n, gen, timeout, group, chosen)

        def device_attention(timeout: float) -> None:
            flags = ("--micro-batches", "8", "--attention-placement", "gpu", "--skip-overlap-off")
            flags += ("--device-kv-memory", str(PREFLIGHT_KV))
            memory = budget.device_memory + PREFLIGHT_KV
            result = self.bench("device-attention", toy_dir, memory, dtype, n, gen, timeout, True, flags)
            if result is not None:
                self.report["device-attention"] = preflight_facts(result)

        def ranks(timeout: float) -> None:
            run_tensor_parallel(self, "tensor-parallel", toy_dir, budget, dtype, n, gen, timeout)

        return [
            OptionalPhase("cuda-tests", 60, 150, self.cuda_tests),
            OptionalPhase("formats", 240 if on_checkpoint else 75, 300 if on_checkpoint else 150, formats),
            OptionalPhase("tensor-parallel", 45, 90, ranks),
            OptionalPhase("device-attention", 35, 60, device_attention),
        ]

    def cuda_tests(self, timeout: float) -> None:
        """The unit tests that need a GPU (the copy engine, the CUDA hand-off path, sync counts)."""
        if importlib.util.find_spec("pytest") is None:
            self.record("cuda-tests", ok=None, skipped="pytest is not installed (bash bench/gpu_wheels.sh fetches it)")
            return
        # a dry run only collects them: without a GPU their CUDA cases skip, and the suite runs the others
        only = ["--collect-only"] if self.args.dry_run else []
        tests = [t for t in CUDA_TESTS if (REPO / t.split("::")[0]).is_file()]
        argv = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests, *only]
        # the image's own pytest plugins were built for its pytest, not the carried one: load none
        self.finish(self.start("cuda-tests", argv, timeout, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}))

    # ---- the report ------------------------------------------------------------------------------
    def fail(self, message: str) -> int:
        log(f"FAILED: {message}")
        self.report["status"] = "failed"
        self.report["error"] = message
        self.report["summary"] = [f"FAILED: {message}"]
        self.save()
        write_archive(self.out, self.collect, self.work)
        return 2

    def conclude(self, final: bool = False, status: str | None = None) -> int:
        """Ratios, the prediction beside the measurement, the summary: printed and written."""
        self.report["ratios"] = ratios(self.report)
        self.report["predicted_vs_measured"] = predicted_vs_measured(self.report)
        complete = len(self.report["ratios"]) == 2
        self.report["status"] = status or (("ok" if complete else "partial") if final else "main comparison done")
        self.report["summary"] = summary_lines(self.report)
        self.save()
        what = f"summary ({status})" if status else "summary" if final else "summary of the main comparison"
        log(f"{what} (also in {self.out / 'gpu_check.json'}):\n" + "\n".join(self.report["summary"]))
        if final or status:
            self.report["outputs"] = {"archive": write_archive(self.out, self.collect, self.work)}
            self.report["outputs"]["problems"] = out_dir_problems(self.out)
            self.save()
        return 0 if complete else 1


def predict_only(a: argparse.Namespace) -> int:
    """The prediction the docs' table shows, for the check's model and budget, without a GPU."""
    import torch

    spec = ModelSpec.from_hf_config(mixtral_config(TOY if a.dry_run else PRESET, "bfloat16"))
    budget = device_budget(spec, a.dtype, a.resident_fraction, capped=True)
    profile, why = profile_for(a.profile, torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    print(f"profile: {profile.name} ({why})")
    print(describe_budget(budget))
    print("\n".join(prediction_table(hrm_prediction(spec, budget, a.dtype, a.batch_cap, a.gen_len, profile))))
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM as SIGINT: stop the phases, keep what was measured


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from bench.gpucheck.workers import WORKERS

    if argv and argv[0] in WORKERS:
        return WORKERS[argv[0]](argv[1:])
    args = parse_args(argv, __doc__)
    if args.predict_only:
        return predict_only(args)
    check = GpuCheck(args)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return check.run()
    except KeyboardInterrupt:  # the outer timeout in gpu_check.sh: stop the phases, keep what was measured
        log("interrupted: stopping the running phases, writing what was measured")
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # one interruption is enough: let the report be written
        check.stop_all(grace=5.0)
        check.conclude(status="interrupted")
        return 130
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
