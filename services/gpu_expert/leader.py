"""Rank 0's side of a tensor-parallel group: it starts the other ranks as its own child processes
(one per device), forms the group with them through a fresh rendezvous file in a private directory,
keeps them awake with heartbeats between steps, and ends the whole group when any rank dies.

Why rank 0 owns the others: the group can only re-form as a whole (a new rendezvous with every
rank), so a dead rank means a new group. Rank 0 exits non-zero and takes the others with it (they
also get SIGTERM from the kernel when it dies); the launcher (or compose) restarts rank 0, which
starts a fresh group, and the orchestrator re-wires the stack as for any dead gpu_expert.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

import structlog

from moe_lightning.children import spawner, with_parent_death
from moe_lightning.private_paths import private_dir
from services.gpu_expert.ranks import Command, RankGroup

STOP_WAIT = 10.0


class GroupLeader:
    def __init__(self, world: int, argv: Sequence[str]) -> None:
        """Starts ranks 1..world-1 with rank 0's own flags (`argv`) and their rank."""
        self.world = world
        self.dir = private_dir(None, prefix="moe-lightning-tp-")
        self.rendezvous = self.dir / "rendezvous"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.group: RankGroup | None = None
        self.failed = threading.Event()
        self._stop = threading.Event()
        self._started = threading.Event()  # every rank ready: watch() takes over from _watch_start_up()
        self.log = structlog.get_logger()
        for rank in range(1, world):
            cmd = [sys.executable, "-m", "services.gpu_expert", *argv]
            cmd += ["--tp-rank", str(rank), "--tp-rendezvous", str(self.rendezvous)]
            self.procs.append(spawner.run(lambda cmd=cmd: subprocess.Popen(with_parent_death(cmd))))
        threading.Thread(target=self._watch_start_up, name="tp-group-start-up", daemon=True).start()

    def _watch_start_up(self) -> None:
        """A rank that exits before the group is ready ends rank 0 at once, with the reason: rank 0
        waits for it in a collective (forming the group, the start-up barrier) that only gives up after
        --tp-startup-timeout, and it cannot be interrupted from Python."""
        while not (self._started.wait(0.25) or self._stop.is_set()):
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None and not self._stop.is_set():
                    reason = f"rank {rank} of {self.world} exited with code {proc.returncode} during start-up"
                    self.log.error("startup_failed", error=reason, action="exiting; its log lines are above")
                    self._kill(signal.SIGKILL)
                    shutil.rmtree(self.dir, ignore_errors=True)
                    os._exit(1)  # the launcher (or compose) restarts rank 0; a dead owner's segments are swept

    def watch(self, lock: threading.Lock, broke: Callable[[str], None]) -> None:
        """From now on: a rank that exits, or a heartbeat that fails, ends the group (`broke` with the
        reason); when no command went out for a while and no step runs (`lock` free), the others get
        a heartbeat, so that their wait for the next command never reaches --tp-timeout."""
        assert self.group is not None
        group = self.group
        self._started.set()

        def loop() -> None:
            while not self._stop.wait(0.25):
                for rank, proc in enumerate(self.procs, start=1):
                    if proc.poll() is not None:
                        return broke(f"rank {rank} of {self.world} exited with code {proc.returncode}")
                quiet = time.monotonic() - group.last_command
                if quiet >= group.heartbeat_seconds and lock.acquire(blocking=False):
                    try:
                        if not self.failed.is_set():
                            group.send_command(Command.HEARTBEAT)
                    except Exception as exc:
                        return broke(str(exc))
                    finally:
                        lock.release()
            return None

        threading.Thread(target=loop, name="tp-group-watch", daemon=True).start()

    def fail(self, reason: str, on_failure: Callable[[str], None]) -> None:
        if self.failed.is_set():
            return
        self.failed.set()
        self.log.error("tensor_parallel_group_failed", reason=reason, action="exiting; the group restarts")
        self._kill(signal.SIGKILL)  # a broken group has nothing to finish; a hung rank would not stop
        on_failure(reason)

    def stop(self, idle: bool) -> None:
        """At shutdown: the others stop (a STOP command when no step runs), then the group closes."""
        self._stop.set()
        if self.group is not None and idle and not self.failed.is_set():
            try:
                self.group.send_command(Command.STOP)
            except Exception as exc:
                self.log.warning("tensor_parallel_stop_failed", error=str(exc))
        for proc in self.procs:
            try:
                proc.wait(STOP_WAIT)
            except subprocess.TimeoutExpired:
                pass
        self._kill()
        if self.group is not None and not self.failed.is_set():  # a broken NCCL group may hang in its teardown
            self.group.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _kill(self, sig: int = signal.SIGTERM) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(sig)
        for proc in self.procs:
            try:
                proc.wait(STOP_WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
