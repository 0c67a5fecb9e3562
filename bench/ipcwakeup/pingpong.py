"""The ping-pong: side B (the peer process), side A's timed round trips, and the kill -9 check.

The peer is started as ``python bench/ipc_wakeup.py --peer MECH NAME``: a fresh interpreter that
shares nothing with side A but the name, as two services started by different supervisors would.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.ipcwakeup.channels import CHANNELS, Channel, Iox2Channel
from bench.ipcwakeup.common import (
    DEAD_BUDGET_S,
    KILL_AFTER_S,
    PREFIX,
    READY_BUDGET_S,
    RT_BUDGET_S,
    SLICE_S,
    PeerDiedError,
    pid_alive,
)

# The entry point, not this module: the peer must parse the same command line as the benchmark.
SCRIPT = Path(__file__).resolve().parent.parent / "ipc_wakeup.py"

# --------------------------------------------------------------------------------------------
# peer (side B)
# --------------------------------------------------------------------------------------------


def raise_exit(signum: int, _frame: object) -> None:
    """SIGTERM as SystemExit, so that finally-blocks unlink the named objects on the way out."""
    raise SystemExit(128 + signum)


def peer_main(mech: str, name: str) -> int:
    """Open the channel by name, signal "ready", then answer every ping until told to stop."""
    signal.signal(signal.SIGTERM, raise_exit)
    parent = os.getppid()
    ch = CHANNELS[mech](name, owner=False)
    try:
        ch.signal()  # ready
        while True:
            r = ch.wait(SLICE_S)
            if r == "ok":
                ch.signal()
            elif r == "eof" or not pid_alive(parent) or os.getppid() != parent:
                return 0
    finally:
        ch.close()


# --------------------------------------------------------------------------------------------
# side A
# --------------------------------------------------------------------------------------------


def wait_peer(ch: Channel, pid: int, budget_s: float) -> None:
    """Wait for one wake-up; raise PeerDiedError if the peer is gone, TimeoutError after budget_s."""
    r = ch.wait(SLICE_S)
    if r == "ok":
        return
    deadline = time.monotonic() + budget_s
    while True:
        if r == "eof":
            raise PeerDiedError("eof")
        if not pid_alive(pid):
            raise PeerDiedError("liveness")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no wake-up within {budget_s}s and peer {pid} still alive")
        r = ch.wait(SLICE_S)
        if r == "ok":
            return


def spawn_peer(mech: str, name: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(SCRIPT), "--peer", mech, name], stdin=subprocess.DEVNULL)


def stop_peer(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def percentile(sorted_vals: list[float], q: float) -> float:
    idx = min(len(sorted_vals) - 1, max(0, round(q * (len(sorted_vals) - 1))))
    return sorted_vals[idx]


def bench_mech(mech: str, n: int, warmup: int) -> dict[str, Any]:
    name = f"{PREFIX}{os.getpid()}-{mech}"
    ch = CHANNELS[mech](name, owner=True)
    try:
        proc = spawn_peer(mech, name)
        try:
            wait_peer(ch, proc.pid, READY_BUDGET_S)
            samples: list[float] = []
            clock = time.perf_counter_ns
            for i in range(warmup + n):
                t0 = clock()
                ch.signal()
                wait_peer(ch, proc.pid, RT_BUDGET_S)
                dt = clock() - t0
                if i >= warmup:
                    samples.append(dt / 1000.0)
        finally:
            stop_peer(proc)
    finally:
        ch.close()
    s = sorted(samples)
    return {
        "n": n,
        "warmup": warmup,
        "median_us": statistics.median(s),
        "p99_us": percentile(s, 0.99),
        "mean_us": statistics.fmean(s),
        "min_us": s[0],
        "max_us": s[-1],
    }


def dead_peer_check(mech: str) -> dict[str, Any]:
    """Both sides mid-wait (A waits for a pong it never asked for, B waits for a ping); SIGKILL B."""
    name = f"{PREFIX}{os.getpid()}-{mech}-dead"
    ch = CHANNELS[mech](name, owner=True)
    result: dict[str, Any] = {"noticed_within_1s": False, "detect_ms": None, "via": None, "hung": False}
    try:
        proc = spawn_peer(mech, name)
        try:
            wait_peer(ch, proc.pid, READY_BUDGET_S)
            for _ in range(10):
                ch.signal()
                wait_peer(ch, proc.pid, RT_BUDGET_S)
            killed_at: list[float] = []

            def kill() -> None:
                killed_at.append(time.monotonic())
                os.kill(proc.pid, signal.SIGKILL)

            killer = threading.Timer(KILL_AFTER_S, kill)
            killer.start()
            try:
                wait_peer(ch, proc.pid, DEAD_BUDGET_S)
                result["via"] = "spurious wake-up"
            except PeerDiedError as exc:
                detect_ms = (time.monotonic() - killed_at[0]) * 1000.0 if killed_at else None
                result.update(detect_ms=detect_ms, via=exc.via)
                result["noticed_within_1s"] = detect_ms is not None and detect_ms <= 1000.0
            except TimeoutError:
                result["hung"] = True
            finally:
                killer.cancel()
                killer.join()
        finally:
            stop_peer(proc)
    finally:
        ch.close()
    if isinstance(ch, Iox2Channel):
        result["stale_nodes_cleaned"] = ch.stale_nodes_cleaned
    return result
