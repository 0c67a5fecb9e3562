"""Cross-process wake-up latency benchmark for a shared-memory data plane.

Why this exists: the shared-memory data plane needs a way for one process to wake another
process when a slot has been written. The two processes are *unrelated* (started separately,
e.g. by different supervisors); they find each other **by name** (a semaphore name, a socket
path, a FIFO path, a shared-memory name), never through inherited file descriptors. This script
measures, on the machine it runs on, what each candidate wake-up mechanism costs and whether a
waiter can always get out of a wait when the peer is killed with SIGKILL (i.e. no wait hangs).

Mechanisms (each benchmarked as a ping-pong: A wakes B, B wakes A back):

* ``sem``   named POSIX semaphores (``posix_ipc``), one per direction, ``acquire(timeout)``
* ``zmq``   ZeroMQ PAIR sockets over ``ipc://`` (pyzmq), ``poll(timeout)`` then ``recv``
* ``fifo``  a pair of named FIFOs (``os.mkfifo``), ``select()`` with a timeout
* ``spin``  pure spinning on a counter in named shared memory (``posix_ipc`` + ``mmap``);
            the latency lower bound, but it burns a whole core while waiting
* ``iox2``  iceoryx2 event services (only if the ``iceoryx2`` package is importable)

The peer is started with ``subprocess`` as ``python bench/ipc_wakeup.py --peer MECH NAME``, so it
shares nothing with the parent except the name. Every wait is done in short timeout slices; on
each timeout the waiter checks the peer's liveness (``os.kill(pid, 0)`` plus a zombie check via
``/proc``). The "dead peer" check kills the peer with SIGKILL while both sides are mid-wait and
records how long the waiter needs to notice.

All named objects are prefixed ``mlt-bench-<pid>-`` and removed in ``finally`` blocks; stale
objects left by a previous run that was itself killed are swept at start-up.

The code: the mechanisms are in bench/ipcwakeup/channels.py; the peer, the timed ping-pong and the
kill -9 check in pingpong.py; names, budgets and liveness in common.py. This file parses the command
line (for the peer too) and prints the report.

Usage::

    python bench/ipc_wakeup.py [--n 5000] [--warmup 500] [--json FILE] [--mech sem,zmq,...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(REPO))

from bench.ipcwakeup.common import ALL_MECHS, our_paths, sweep_stale  # noqa: E402
from bench.ipcwakeup.pingpong import bench_mech, dead_peer_check, peer_main, raise_exit  # noqa: E402


def mech_available(mech: str) -> str | None:
    mod = {"sem": "posix_ipc", "spin": "posix_ipc", "zmq": "zmq", "iox2": "iceoryx2", "fifo": None}[mech]
    if mod is None:
        return None
    try:
        __import__(mod)
    except ImportError as exc:
        return f"skipped ({exc})"
    return None


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(results: dict[str, Any], dead: dict[str, Any], skipped: dict[str, str]) -> None:
    hdr = f"{'mech':<6} {'median_us':>10} {'p99_us':>10} {'mean_us':>10}  {'kill-9 noticed':>14} {'detect_ms':>9}  via"
    print(hdr)
    print("-" * len(hdr))
    for mech in list(results) + list(skipped):
        if mech in skipped:
            print(f"{mech:<6} {skipped[mech]}")
            continue
        r, d = results[mech], dead.get(mech, {})
        if "error" in r:
            print(f"{mech:<6} error: {r['error']}")
            continue
        noticed = "HUNG" if d.get("hung") else ("yes" if d.get("noticed_within_1s") else "no")
        print(
            f"{mech:<6} {fmt(r['median_us']):>10} {fmt(r['p99_us']):>10} {fmt(r['mean_us']):>10}  "
            f"{noticed:>14} {fmt(d.get('detect_ms')):>9}  {d.get('via') or d.get('error', '-')}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", nargs=2, metavar=("MECH", "NAME"), help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=5000, help="measured round trips per mechanism")
    ap.add_argument("--warmup", type=int, default=500, help="unmeasured warm-up round trips")
    ap.add_argument("--mech", default=",".join(ALL_MECHS), help="comma-separated subset of " + ",".join(ALL_MECHS))
    ap.add_argument("--json", metavar="FILE", help="also write the numbers as JSON")
    args = ap.parse_args(argv)
    if args.peer:
        return peer_main(*args.peer)

    signal.signal(signal.SIGTERM, raise_exit)  # so finally-blocks run on SIGTERM too
    t_start = time.monotonic()
    swept = sweep_stale()
    mechs = [m.strip() for m in args.mech.split(",") if m.strip()]
    results: dict[str, Any] = {}
    dead: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for mech in mechs:
        why = mech_available(mech)
        if why:
            skipped[mech] = why
            continue
        try:
            results[mech] = bench_mech(mech, args.n, args.warmup)
        except Exception as exc:  # report and go on with the other mechanisms
            results[mech] = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            dead[mech] = dead_peer_check(mech)
        except Exception as exc:
            dead[mech] = {"error": f"{type(exc).__name__}: {exc}", "noticed_within_1s": False}
    leftovers = our_paths(os.getpid())
    elapsed = time.monotonic() - t_start

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    print(
        f"ipc wake-up round trip, n={args.n} (+{args.warmup} warm-up), "
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"cpus={os.cpu_count()} (usable {affinity}), kernel {platform.release()}"
    )
    print_table(results, dead, skipped)
    survivors = {
        m: r["median_us"]
        for m, r in results.items()
        if "median_us" in r and dead.get(m, {}).get("noticed_within_1s") and m != "spin"
    }
    best = min(survivors, key=survivors.__getitem__) if survivors else None
    print(f"fastest blocking mechanism that noticed kill -9 within 1s: {best or '-'}")
    print(f"stale objects swept: {len(swept)}; leftovers after run: {leftovers or 'none'}; total {elapsed:.1f}s")

    if args.json:
        payload = {
            "n": args.n,
            "warmup": args.warmup,
            "python": platform.python_version(),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "usable_cpus": affinity,
            "results": results,
            "dead_peer": dead,
            "skipped": skipped,
            "fastest_surviving_blocking": best,
            "swept": swept,
            "leftovers": leftovers,
            "elapsed_s": elapsed,
        }
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=2)
    return 0 if not leftovers else 1


if __name__ == "__main__":
    sys.exit(main())
