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
import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from moe_lightning.benchmark import left_pad  # noqa: E402
from moe_lightning.demo_model import PRESETS, mixtral_config  # noqa: E402
from moe_lightning.flags import format_size  # noqa: E402
from moe_lightning.spec import ModelSpec  # noqa: E402

PRESET = "mixtral-8x7b-4l"
# The toy for the preflight and --dry-run: the real model's layer and expert counts (so the budget
# rule gives the same residency plan), tiny widths.
TOY = {**PRESETS["tiny"], "num_hidden_layers": 4, "num_local_experts": 8}
TARGETS = {"ours_over_overlap_off": 3.0, "ours_over_offload": 10.0}
# Besides the weight arena, /dev/shm holds cpu_attention's KV cache (run_batch asks for 4 GiB) and the
# two hand-off channels (4 slots each of the services' default 8192 tokens per hand-off).
KV_CACHE_BYTES = 4 << 30
HANDOFF_SLOTS, HANDOFF_TOKENS = 4, 8192
# Modules a service imports; a failure here names the wheel to fetch (see gpu_check.sh).
IMPORTS = (
    "structlog",
    "posix_ipc",
    "grpc_health.v1.health",
    "grpc_reflection.v1alpha.reflection",
    "prometheus_client",
    "pyarrow",
    "tqdm",
    "moe_lightning.api.generation.v1.generation_pb2_grpc",  # fails on a grpcio/protobuf older than its gencode
    "services.gpu_expert.server",
    "services.cpu_attention.server",
    "services.weight_store.server",
    "orchestrator.server",
)
DISTRIBUTIONS = ("torch", "transformers", "accelerate", "safetensors", "tokenizers", "grpcio", "protobuf", "structlog")


def log(msg: str) -> None:
    sys.stderr.write(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


# ---- the device budget -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Budget:
    device_memory: int  # what --device-memory gets
    dense_bytes: int
    expert_bytes: int  # one expert (w13 + w2)
    resident_experts: int  # what gpu_expert's plan keeps on the device at this budget
    total_experts: int
    ring_bytes: int  # the streaming buffers
    arena_bytes: int  # the whole weight arena in /dev/shm

    @property
    def resident_fraction(self) -> float:
        return self.resident_experts / self.total_experts


def device_budget(spec: ModelSpec, dtype: str, resident_fraction: float) -> Budget:
    """The smallest budget at which gpu_expert's own residency plan keeps at least `resident_fraction`
    of the experts on the device, besides the dense weights and its streaming buffers.

    Sizes are computed as gpu_expert computes them (the arena layout), and the plan is gpu_expert's
    `plan_residency`, so the rule follows the ring's sizing as it changes. The plan only moves at
    whole experts, so half an expert of margin absorbs small accounting differences without
    changing the plan.
    """
    from moe_lightning.arena import ArenaLayout, expert_page_names
    from services.gpu_expert.residency import DeviceBudgetError, plan_residency

    layout = ArenaLayout.for_spec(spec, dtype)
    w13, w2 = (layout.pages[n] for n in expert_page_names(spec.experts_per_layer.index(spec.num_experts), 0))
    expert = w13.nbytes + w2.nbytes
    total = spec.total_experts
    dense = layout.total_bytes - total * expert
    target = round(resident_fraction * total)
    for slots in range(total + 1):  # at slots == total everything fits, so this always returns
        try:
            plan = plan_residency(
                spec.num_layers, spec.num_experts, expert, dense, dense + slots * expert, dense_layers=spec.dense_layers
            )
        except DeviceBudgetError:
            continue
        resident = sum(len(r) for r in plan.resident)
        if resident >= target:
            ring = plan.device_bytes - dense - resident * expert
            return Budget(
                dense + slots * expert + expert // 2, dense, expert, resident, total, ring, layout.total_bytes
            )
    raise AssertionError("unreachable: the whole model fits at slots == total")


def shm_needed(spec: ModelSpec, budget: Budget) -> int:
    """Bytes one stack keeps in /dev/shm (the stacks of a bench run one after the other)."""
    from moe_lightning.handoff import handoff_slot_bytes

    channels = HANDOFF_SLOTS * sum(handoff_slot_bytes(spec, HANDOFF_TOKENS, kind) for kind in ("qkv", "attn"))
    return budget.arena_bytes + KV_CACHE_BYTES + channels + (256 << 20)  # + slack for small segments


def describe_budget(b: Budget) -> str:
    size = format_size
    return (
        f"--device-memory {b.device_memory} ({size(b.device_memory)}) = dense {size(b.dense_bytes)}"
        f" + ring {size(b.ring_bytes)} ({b.ring_bytes // b.expert_bytes} experts)"
        f" + {b.resident_experts} of {b.total_experts} experts resident ({b.resident_fraction:.0%},"
        f" {size(b.resident_experts * b.expert_bytes)}) + {size(b.expert_bytes // 2)} margin"
    )


# ---- the workload ------------------------------------------------------------------------------
def bench_prompts(model: Path, vocab: int, n: int) -> list[list[int]]:
    """Exactly the prompts `moe-lightning bench --workload mtbench --num-prompts n` sends (its own
    function), so every system sees the same token ids."""
    from moe_lightning.commands.bench import _prompts

    return _prompts(argparse.Namespace(workload="mtbench", num_prompts=n, model=model), vocab)


def prompts_digest(prompts: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


# ---- baseline: transformers + accelerate offloading --------------------------------------------
def _dtype_kwarg() -> str:
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # `dtype` replaced `torch_dtype` in 4.56


def _generate_chunks(
    model: Any, prompts: list[list[int]], gen_len: int, batch: int, device: torch.device
) -> tuple[float, int, int]:
    """Greedy generate over `prompts` in chunks of `batch`, left padded per chunk; returns (seconds,
    generated tokens, padded prompt tokens)."""
    generated = padded = 0
    wall = 0.0
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        ids, mask = left_pad(chunk, device)
        width = ids.shape[1]
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=gen_len,
                min_new_tokens=gen_len,
                do_sample=False,
                pad_token_id=0,
            )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall += time.perf_counter() - t0
        generated += (out.shape[1] - width) * len(chunk)
        padded += width * len(chunk)
        del out
    return wall, generated, padded


def transformers_offload_generate(
    model_dir: Path, prompts: list[list[int]], gen_len: int, max_memory_bytes: int, dtype: torch.dtype = torch.bfloat16
) -> dict[str, Any]:
    """transformers' generate with accelerate offloading: the layers that do not fit in
    `max_memory_bytes` of GPU 0 stay in host memory and are copied in at every forward pass (how one
    runs a model larger than the GPU with transformers). sdpa, greedy, exactly `gen_len` new tokens.

    The KV cache must live on the GPU, so the batch is the largest that fits: the whole set first,
    halved on CUDA out-of-memory, the prompts then run in chunks of that size (timed from scratch).
    Without CUDA (--dry-run) the model loads on the CPU and the budget is not applied.
    """
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    kwargs: dict[str, Any] = {_dtype_kwarg(): dtype, "attn_implementation": "sdpa"}
    if cuda:
        kwargs.update(device_map="auto", max_memory={0: max_memory_bytes, "cpu": "100GiB"})
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).eval()
    load_seconds = time.perf_counter() - t0
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    placement: dict[str, int] = {}  # parameter bytes accelerate placed on each device
    for name, where in getattr(model, "hf_device_map", {}).items():
        module = model.get_submodule(name) if name else model
        nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
        placement[str(where)] = placement.get(str(where), 0) + nbytes
    with torch.no_grad():  # warm-up: kernels, allocator, accelerate's hooks
        warm = torch.tensor([prompts[0][-4:]], device=device)
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False, pad_token_id=0)
    batch, ooms = len(prompts), 0
    while True:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            wall, generated, padded = _generate_chunks(model, prompts, gen_len, batch, device)
            break
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
            ooms += 1
        # out of the except block, so the failed attempt's tensors are unreferenced before retrying
        batch = max(1, batch // 2)
    return {
        "generated_tokens_per_second": generated / wall,
        "seconds": wall,
        "generated_tokens": generated,
        "batch_size": batch,
        "chunks": -(-len(prompts) // batch),
        "oom_retries": ooms,
        "padded_prompt_tokens": padded,
        "load_seconds": load_seconds,
        "max_memory_bytes": max_memory_bytes if cuda else None,
        "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "placement_bytes": placement,  # on GPU 0 ("0") vs offloaded ("cpu")
        "dtype": str(dtype).removeprefix("torch."),
    }


# ---- the workers (each phase's subprocess) -----------------------------------------------------
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
    p = argparse.ArgumentParser(prog="gpu_check.py _offload")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--max-memory", type=int, required=True)
    p.add_argument("--num-prompts", type=int, required=True)
    p.add_argument("--gen-len", type=int, required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--json", type=Path, required=True)
    a = p.parse_args(argv)
    spec = ModelSpec.from_pretrained(a.model)
    prompts = bench_prompts(a.model, spec.vocab_size, a.num_prompts)
    result = transformers_offload_generate(a.model, prompts, a.gen_len, a.max_memory, getattr(torch, a.dtype))
    result["prompts_sha256"] = prompts_digest(prompts)
    a.json.write_text(json.dumps(result, indent=2))
    log(f"offload: {result['generated_tokens_per_second']:.1f} tok/s at batch {result['batch_size']}")
    return 0


WORKERS = {"_build": _build_main, "_bench": _bench_main, "_offload": _offload_main}


# ---- running phases ----------------------------------------------------------------------------
def _descendants(pid: int) -> list[int]:
    """Every process below `pid`. The launcher starts services in sessions of their own, so they are
    found by parentage, not by process group."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _log_dir(run_id: str) -> Path:
    return Path(f"/tmp/moe-lightning-bench-{run_id}")  # where run_batch has the launcher put service logs


def _service_logs(pid: int) -> list[tuple[str, Path]]:
    """The service logs of the stacks a bench process ran (run ids bench<its pid><overlap>)."""
    return [
        (label, f)
        for overlap, label in ((1, "overlap"), (0, "no-overlap"))
        for f in sorted(_log_dir(f"bench{pid}{overlap}").glob("*.log"))
    ]


def _live_services(pid: int) -> dict[Path, int]:
    """Log file -> pid of every service process still running below `pid` (from its command line:
    `python -m <module> ... --run-id <run>`, as the launcher starts it)."""
    from moe_lightning.launcher import SERVICES

    names = {module: name for name, (module, _) in SERVICES.items()}
    live = {}
    for child in _descendants(pid):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue  # gone meanwhile
        if "-m" in argv and "--run-id" in argv and argv[argv.index("-m") + 1] in names:
            name = names[argv[argv.index("-m") + 1]]
            live[_log_dir(argv[argv.index("--run-id") + 1]) / f"{name}.log"] = child
    return live


@dataclass
class Phase:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    started: float
    timeout: float
    stack: bool = False  # runs our services: keep their logs' tails
    fail_fast: bool = False  # stop at a service thread's death instead of waiting for the timeout
    ended: float | None = None  # set by a watcher thread: a phase in the background ends unobserved
    suspects: dict[Path, float] = field(default_factory=dict)  # service log -> when a dead thread showed

    def watch(self) -> None:
        self.proc.wait()
        self.ended = time.monotonic()


class GpuCheck:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.json_path: Path = args.json
        self.logs = self.json_path.parent / "gpu_check-logs"
        self.work = Path(args.work_dir)
        self.deadline = time.monotonic() + args.deadline
        self.env = {
            **os.environ,
            # the services are started as `python -m services.<name>`: the repository must be importable
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
            "HF_HUB_OFFLINE": "1",  # no network on the GPU machine: never wait on a hub lookup
            "PYTHONUNBUFFERED": "1",
        }
        self.running: list[Phase] = []
        self.report: dict[str, Any] = {"status": "running", "dry_run": args.dry_run, "phases": {}}

    def save(self) -> None:
        self.json_path.write_text(json.dumps(self.report, indent=2, default=str))

    def record(self, name: str, **fields: Any) -> None:
        self.report["phases"].setdefault(name, {}).update(fields)
        self.save()

    def timeout(self, cap: float, reserve: float) -> float:
        """At most `cap`, leaving `reserve` seconds of the deadline for the phases after this one."""
        return min(cap, self.deadline - time.monotonic() - reserve)

    def start(
        self, name: str, argv: list[str], timeout: float, stack: bool = False, fail_fast: bool = False
    ) -> Phase | None:
        if timeout < 20:
            self.record(name, ok=False, skipped=f"only {timeout:.0f} s left before the deadline")
            log(f"{name}: skipped, {timeout:.0f} s left before the deadline")
            return None
        path = self.work / "logs" / f"{name}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            proc = subprocess.Popen(
                [sys.executable, *argv], cwd=REPO, env=self.env, stdout=fd, stderr=subprocess.STDOUT
            )
        finally:
            os.close(fd)  # the child has its own copy
        log(f"{name}: started (timeout {timeout:.0f} s, log {path})")
        phase = Phase(name, proc, path, time.monotonic(), timeout, stack, fail_fast)
        threading.Thread(target=phase.watch, name=f"watch-{name}", daemon=True).start()
        self.running.append(phase)
        return phase

    def _dead_thread(self, phase: Phase, grace: float = 10.0) -> str | None:
        """A service whose thread died of an exception (Python prints "Exception in thread") and that
        is still running `grace` seconds later (one shutting down is gone by then): the stack is
        broken, and waiting out its hand-off timeouts only burns device time."""
        now = time.monotonic()
        for log_file, pid in _live_services(phase.proc.pid).items():
            if log_file not in phase.suspects:
                if "Exception in thread" in log_file.read_text(errors="replace"):
                    phase.suspects[log_file] = now
            elif now - phase.suspects[log_file] >= grace:
                return f"a thread died in pid {pid} (log {log_file})"
        return None

    def finish(self, phase: Phase | None) -> bool:
        """Waits for a phase (stopping it at its timeout, or at once when a service thread died);
        records and returns whether it succeeded."""
        if phase is None:
            return False
        reason = None
        while phase.proc.poll() is None:
            if time.monotonic() > phase.started + phase.timeout:
                reason = f"timed out after {phase.timeout:.0f} s"
            elif phase.fail_fast:
                try:
                    reason = self._dead_thread(phase)
                except Exception as exc:  # only a shortcut: the timeout still bounds the phase
                    log(f"{phase.name}: cannot watch the services ({exc}); waiting for the phase or its timeout")
                    phase.fail_fast = False
            if reason:
                log(f"{phase.name}: {reason}: stopping it")
                self.stop(phase)
                break
            time.sleep(1.0)
        self.running.remove(phase)
        phase.proc.wait()
        rc, seconds = phase.proc.returncode, (phase.ended or time.monotonic()) - phase.started
        ok = rc == 0 and reason is None
        self.logs.mkdir(parents=True, exist_ok=True)
        tail = phase.log_path.read_text(errors="replace").splitlines()[-300:]
        (self.logs / phase.log_path.name).write_text("\n".join(tail) + "\n")
        if phase.stack:
            for label, f in _service_logs(phase.proc.pid):
                text = "\n".join(f.read_text(errors="replace").splitlines()[-200:])
                (self.logs / f"{phase.name}-{label}-{f.name}").write_text(text + "\n")
        self.record(phase.name, ok=ok, rc=rc, seconds=round(seconds, 1), stopped=reason)
        if ok:
            log(f"{phase.name}: ok in {seconds:.1f} s")
        else:
            self.record(phase.name, log_tail="\n".join(tail[-15:]))
            log(f"{phase.name}: FAILED (rc {rc}{f', {reason}' if reason else ''}) after {seconds:.1f} s; last lines:")
            sys.stderr.write("".join(f"    {line}\n" for line in tail[-15:]))
        return ok

    def stop(self, phase: Phase) -> None:
        """Kills the services below the phase first: the stack failed or ran out of time, so there is
        nothing to drain, and a graceful stop would wait out each service's grace period (~30 s of
        device time). Then SIGINT, so the bench's own clean-up runs, and SIGKILL if it lingers."""
        for pid in _descendants(phase.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        phase.proc.send_signal(signal.SIGINT)
        try:
            phase.proc.wait(30)
        except subprocess.TimeoutExpired:
            phase.proc.kill()
            phase.proc.wait()
        from moe_lightning.shm.segment import sweep_stale

        swept = sweep_stale()  # only segments whose creating process is gone
        if swept:
            log(f"{phase.name}: swept {len(swept)} leftover shared-memory segments")

    def stop_all(self) -> None:
        for phase in list(self.running):
            self.stop(phase)
            self.running.remove(phase)

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
    ) -> dict[str, Any] | None:
        """`moe-lightning bench` with gpu_expert on the device and the arena in `dtype`; its JSON."""
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
        args += ["--micro-batch-size", str(self.args.micro_batch_size)] if self.args.micro_batch_size else []
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

        preset = TOY if a.dry_run else PRESET
        config = mixtral_config(preset, "bfloat16")
        spec = ModelSpec.from_hf_config(config)
        model_dir = self.work / ("toy" if a.dry_run else PRESET)
        checkpoint_bytes = 2 * spec.num_parameters()
        self.report["model"] = {
            "preset": "toy" if a.dry_run else PRESET,
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
        return self.conclude(bench, offload)

    def preflight(self) -> str | None:
        """The bench on the toy model; returns the dtype our stack works in on this machine, or None.

        When the requested dtype fails the fallback is tried, so one fault (say, a dtype mismatch
        between the device and the attention service) still leaves numbers to read, marked as such."""
        a = self.args
        toy_dir = self.work / "preflight"
        if not self.finish(self.build(toy_dir, TOY, self.timeout(60, 300))):
            return None
        toy = ModelSpec.from_hf_config(mixtral_config(TOY, "bfloat16"))
        for dtype in [a.dtype] + ([a.fallback_dtype] if a.fallback_dtype not in ("none", a.dtype) else []):
            budget = device_budget(toy, dtype, a.resident_fraction)
            timeout = self.timeout(120, 240)
            if self.bench(f"preflight-{dtype}", toy_dir, budget, dtype, 4, 4, timeout, fail_fast=True) is not None:
                if dtype != a.dtype:
                    self.report["dtype_fallback"] = (
                        f"our stack failed in {a.dtype} on the toy model; ours ran in {dtype}"
                    )
                    log(f"WARNING: {self.report['dtype_fallback']}")
                return dtype
        return None

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


def environment() -> dict[str, Any]:
    """What ran where: GPU, versions, and which service imports fail (a missing wheel, or a grpcio or
    protobuf older than the generated code)."""
    import importlib
    import platform
    from importlib.metadata import PackageNotFoundError, version

    env: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(), "cuda": torch.version.cuda}
    versions = {}
    for dist in DISTRIBUTIONS:
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = None
    env["versions"] = versions
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = {
            "name": props.name,
            "memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}",
        }
    shm = shutil.disk_usage("/dev/shm")
    env["dev_shm"] = {"total_bytes": shm.total, "free_bytes": shm.free}
    errors = []
    for mod in IMPORTS:
        try:
            importlib.import_module(mod)
        except Exception as exc:  # any import-time failure is a finding, not a crash of the check
            errors.append(f"{mod}: {type(exc).__name__}: {exc}")
    env["import_errors"] = errors
    log(f"{env.get('gpu', {}).get('name', 'no GPU')}, torch {torch.__version__}, {versions}")
    return env


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
    p.add_argument("--seed", type=int, default=0, help="the checkpoint's weights")
    p.add_argument("--work-dir", default="/tmp/moe-lightning-gpu-check", help="checkpoints, arena copy, logs")
    p.add_argument("--json", type=Path, default=Path("gpu_check.json"), help="the report (logs go next to it)")
    p.add_argument("--deadline", type=float, default=440.0, help="seconds for everything; phases share them")
    p.add_argument(
        "--preflight",
        choices=["auto", "on", "off"],
        default="auto",
        help="toy-model run first (auto: not in a dry run)",
    )
    p.add_argument("--skip-offload", action="store_true", help="leave out the accelerate offload baseline")
    p.add_argument("--with-transformers", action="store_true", help="also bench's baseline (a) (CPU, fp32: slow)")
    p.add_argument("--dry-run", action="store_true", help="the toy model on the CPU: checks the flow, not speed")
    a = p.parse_args(argv)
    a.device = "cpu" if a.dry_run else "cuda"
    a.num_prompts = a.num_prompts or (4 if a.dry_run else 64)
    a.gen_len = a.gen_len or (4 if a.dry_run else 32)
    a.dtype = a.dtype or ("float32" if a.dry_run else "bfloat16")
    a.preflight = a.preflight == "on" or (a.preflight == "auto" and not a.dry_run)  # a dry run's model is the toy
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
