"""Phases as subprocesses: start, watch (a service thread that died stops the phase early), stop
(services first: nothing to drain), and the report they are recorded in."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.gpucheck import log
from bench.gpucheck.outputs import write_report

REPO = Path(__file__).resolve().parent.parent.parent
SCRIPT = REPO / "bench" / "gpu_check.py"  # the phases' subprocesses run its workers (_build, _bench, ...)


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


def _log_dir(run_id: str) -> Path | None:
    """Where run_batch had the launcher put this run's service logs: a private mkdtemp directory named
    moe-lightning-bench-<run id>-XXXXXXXX (moe_lightning.benchmark.bench_log_prefix) under the
    launcher's runtime_root(); only directories of ours that nobody else can enter count, the newest."""
    from moe_lightning.private_paths import not_private, runtime_root

    found = [d for d in runtime_root().glob(f"moe-lightning-bench-{run_id}-*") if not_private(d) is None]
    return max(found, key=lambda d: d.stat().st_mtime, default=None)


def _service_logs(pid: int) -> list[tuple[str, Path]]:
    """The service logs of the stacks a bench process ran (run ids bench<its pid><overlap>)."""
    return [
        (label, f)
        for overlap, label in ((1, "overlap"), (0, "no-overlap"))
        if (d := _log_dir(f"bench{pid}{overlap}")) is not None
        for f in sorted(d.glob("*.log"))
    ]


def _live_services(pid: int) -> dict[Path, int]:
    """Log file -> pid of every service process still running below `pid` (from its command line:
    `python -m <module> ... --run-id <run>`, as the launcher starts it)."""
    from moe_lightning.launcher import SERVICES

    names = {kind.module: name for name, kind in SERVICES.items()}
    live = {}
    for child in _descendants(pid):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue  # gone meanwhile
        if "-m" in argv and "--run-id" in argv and argv[argv.index("-m") + 1] in names:
            name = names[argv[argv.index("-m") + 1]]
            log_dir = _log_dir(argv[argv.index("--run-id") + 1])
            if log_dir is not None:
                live[log_dir / f"{name}.log"] = child
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
    results: Path | None = None  # a JSON the phase rewrites as it goes (bench's, after every run)
    seen: float = 0.0  # that file's last modification looked at

    def watch(self) -> None:
        self.proc.wait()
        self.ended = time.monotonic()


class PhaseRunner:
    """Runs phases as subprocesses under one deadline, records each in the JSON report (rewritten
    whole after every phase, so a run cut short still leaves every figure measured so far) and keeps
    the tails of their logs and of their services' logs in the work dir, for the archive."""

    def __init__(self, args: argparse.Namespace) -> None:
        from moe_lightning.private_paths import private_dir

        self.args = args
        # never a fixed path under /tmp: another user could have made it first and planted files in it
        self.work = private_dir(Path(args.work_dir) if args.work_dir else None, prefix="moe-lightning-gpu-check-")
        self.out: Path = args.out or self.work / "out"  # a folder of its own: its limits are checked
        self.out.mkdir(parents=True, exist_ok=True)
        self.collect = self.work / "collect"  # what the archive holds: log tails, bench JSONs, the trace
        self.logs = self.collect / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.deadline
        # seconds into the whole script (gpu_check.sh exports when it began: its wheel install comes first)
        began = os.environ.get("GPU_CHECK_STARTED")
        self.script_offset = max(0.0, time.time() - float(began)) if began else 0.0
        self.env = {
            **os.environ,
            # the services are started as `python -m services.<name>`: the repository must be importable
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
            "HF_HUB_OFFLINE": "1",  # no network on the GPU machine: never wait on a hub lookup
            "PYTHONUNBUFFERED": "1",  # a phase cut off still shows how far it got
        }
        self.running: list[Phase] = []
        self.report: dict[str, Any] = {"status": "running", "dry_run": args.dry_run, "phases": {}, "partial": {}}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.report["elapsed_seconds"] = round(time.monotonic() - self.t0, 1)
        write_report(self.out, self.report)

    def record(self, name: str, **fields: Any) -> None:
        self.report["phases"].setdefault(name, {}).update(fields)
        self.save()

    def timeout(self, cap: float, reserve: float) -> float:
        """At most `cap`, leaving `reserve` seconds of the deadline for the phases after this one."""
        return min(cap, self.left() - reserve)

    def start(
        self,
        name: str,
        argv: list[str],
        timeout: float,
        stack: bool = False,
        fail_fast: bool = False,
        env: dict[str, str] | None = None,
    ) -> Phase | None:
        if timeout < 20:
            self.record(name, ok=None, skipped=f"only {timeout:.0f} s left before the deadline")
            log(f"{name}: skipped, {timeout:.0f} s left before the deadline")
            return None
        path = self.work / "logs" / f"{name}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-u", *argv],
                cwd=REPO,
                env={**self.env, **(env or {})},
                stdout=fd,
                stderr=subprocess.STDOUT,
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
            self.fold_results(phase)
            if reason:
                log(f"{phase.name}: {reason}: stopping it")
                self.stop(phase, grace=min(30.0, max(5.0, self.left())))  # its clean-up, not the next phase's time
                break
            time.sleep(0.5)
        self.running.remove(phase)
        phase.proc.wait()
        self.fold_results(phase)
        rc, seconds = phase.proc.returncode, (phase.ended or time.monotonic()) - phase.started
        ok = rc == 0 and reason is None
        self.keep_tails(phase)
        self.record(phase.name, ok=ok, rc=rc, seconds=round(seconds, 1), stopped=reason)
        if ok:
            log(f"{phase.name}: ok in {seconds:.1f} s")
        else:
            tail = phase.log_path.read_text(errors="replace").splitlines()[-15:]
            self.record(phase.name, log_tail="\n".join(tail))
            log(f"{phase.name}: FAILED (rc {rc}{f', {reason}' if reason else ''}) after {seconds:.1f} s; last lines:")
            sys.stderr.write("".join(f"    {line}\n" for line in tail))
        return ok

    def fold_results(self, phase: Phase) -> None:
        """A phase's results as they are written (bench rewrites its JSON after every run): each run's
        arrival is recorded (seconds into the script) and the partial numbers saved in the report at
        once, so a phase stopped by its timeout, or a check cut short, keeps what was measured."""
        try:
            mtime = phase.results.stat().st_mtime if phase.results is not None else 0.0
        except FileNotFoundError:
            return
        if not mtime or mtime == phase.seen:
            return
        phase.seen = mtime
        try:
            data = json.loads(phase.results.read_text())  # type: ignore[union-attr]
        except (OSError, ValueError):
            return  # (bench replaces it whole: a failed read is a race with the next version)
        at = round(time.monotonic() - self.t0 + self.script_offset, 1)  # seconds into the script
        saved = self.report["phases"].setdefault(phase.name, {}).setdefault("runs_saved", {})
        for run, numbers in data.items():  # a run's numbers: ours, overlap_off, ... (not the ratios)
            if isinstance(numbers, dict) and "generated_tokens_per_second" in numbers and run not in saved:
                saved[run] = at
        self.report["partial"][phase.name] = data
        self.save()

    def keep_tails(self, phase: Phase) -> None:
        """The last lines of the phase's log and of its services' logs, for the archive."""
        tail = phase.log_path.read_text(errors="replace").splitlines()[-300:]
        (self.logs / phase.log_path.name).write_text("\n".join(tail) + "\n")
        if phase.stack:
            for label, f in _service_logs(phase.proc.pid):
                text = "\n".join(f.read_text(errors="replace").splitlines()[-200:])
                (self.logs / f"{phase.name}-{label}-{f.name}").write_text(text + "\n")

    def stop(self, phase: Phase, grace: float = 30.0) -> None:
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
            phase.proc.wait(grace)
        except subprocess.TimeoutExpired:
            phase.proc.kill()
            phase.proc.wait()
        from moe_lightning.shm.segment import sweep_stale

        swept = sweep_stale()  # only segments whose creating process is gone
        if swept:
            log(f"{phase.name}: swept {len(swept)} leftover shared-memory segments")

    def stop_all(self, grace: float = 30.0) -> None:
        for phase in list(self.running):
            self.stop(phase, grace)
            self.running.remove(phase)
            try:
                self.keep_tails(phase)
                self.record(phase.name, ok=False, stopped="interrupted")
            except OSError:  # the tails are a courtesy: what was measured is saved either way
                pass

    # ---- the two kinds of phase that need more than an argv ------------------------------------
    def build(self, out: Path, preset: str | dict[str, Any], timeout: float) -> Phase | None:
        """A checkpoint in bf16 (Mixtral's own dtype), generated on the device under test."""
        text = preset if isinstance(preset, str) else json.dumps(preset)
        argv = [str(SCRIPT), "_build", "--out", str(out), "--preset", text, "--dtype", "bfloat16"]
        argv += ["--device", self.args.device, "--seed", str(self.args.seed)]
        return self.start(f"build-{out.name}", argv, timeout)

    def bench(
        self,
        name: str,
        model: Path,
        device_memory: int | str,
        dtype: str,
        prompts: int,
        gen_len: int,
        timeout: float,
        fail_fast: bool = False,
        extra: tuple[str, ...] = (),
        trace: bool = False,
    ) -> dict[str, Any] | None:
        """`moe-lightning bench` with gpu_expert on the device and the arena in `dtype`; its JSON
        (kept in the work dir for the archive; the caller folds its numbers into the report).
        `extra`: more bench flags; `trace`: keep our run's Chrome trace too."""
        result = self.collect / f"{name}.json"
        result.unlink(missing_ok=True)
        args = ["--model", str(model), "--workload", "mtbench", "--num-prompts", str(prompts)]
        args += ["--gen-len", str(gen_len), "--device-memory", str(device_memory), "--json-out", str(result)]
        args += ["--trace", str(self.collect / f"{name}-trace.json")] if trace else []
        args += [] if self.args.with_transformers else ["--skip-transformers"]
        # the reference runs (whole model resident, experts computed on the host in bf16 on the CPU)
        # would not fit the time budget; ours vs (b) and vs offload are what the check is for
        args += ["--skip-references"]
        # one batch admitted at once: alternating steps run what mixed ones do (bench/step_schedules.py
        # measures them), not worth a run of the lease
        args += ["--skip-alternating"]
        # the paper's configuration: non-resident experts stream to the GPU (CGOPipe is what is checked)
        args += ["--experts-placement", "gpu", *extra]
        device = ["--device", self.args.device, "--dtype", dtype]
        command = " ".join(["moe-lightning", "bench", *args])
        self.record(name, command=f"{command}  # gpu_expert --device {self.args.device}, weight_store --dtype {dtype}")
        phase = self.start(
            name, [str(SCRIPT), "_bench", *device, "--", *args], timeout, stack=True, fail_fast=fail_fast
        )
        if phase is not None:
            phase.results = result
        ok = self.finish(phase)
        # what it wrote before a failure or its timeout stopped it counts too (bench saves after every run)
        data = self.report["partial"].pop(name, None)
        if data is not None and not ok:
            self.record(name, partial=sorted(self.report["phases"][name].get("runs_saved", {})))
        return data
