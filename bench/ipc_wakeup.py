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

Usage::

    python bench/ipc_wakeup.py [--n 5000] [--warmup 500] [--json FILE] [--mech sem,zmq,...]
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import mmap
import os
import platform
import re
import select
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

PREFIX = "mlt-bench-"
ALL_MECHS = ("sem", "zmq", "fifo", "spin", "iox2")
SLICE_S = 0.1  # wait slice; liveness is checked after every slice that times out
READY_BUDGET_S = 15.0  # peer start-up (interpreter + imports)
RT_BUDGET_S = 2.0  # a single round trip may not take longer than this
DEAD_BUDGET_S = 5.0  # hard upper bound for the dead-peer wait (the "never hangs" guarantee)
KILL_AFTER_S = 0.35  # the dead-peer check kills the peer this long after the waiter started waiting
TMPDIR = tempfile.gettempdir()


class PeerDiedError(RuntimeError):
    """The peer process is gone; ``via`` says how we found out."""

    def __init__(self, via: str) -> None:
        super().__init__(f"peer died (detected via {via})")
        self.via = via


# --------------------------------------------------------------------------------------------
# liveness
# --------------------------------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie.

    ``os.kill(pid, 0)`` alone succeeds on a zombie; that matters here because the benchmark's peer
    is our child and stays a zombie until reaped. Between truly unrelated processes the zombie is
    reaped by its own parent, but checking the /proc state is cheap and makes the check exact.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


# --------------------------------------------------------------------------------------------
# channels: one per mechanism. owner=True is side A (creates + unlinks), owner=False is side B.
# wait() returns "ok", "timeout" or "eof" (the mechanism itself reported the peer gone).
# --------------------------------------------------------------------------------------------


class Channel:
    def __init__(self, name: str, owner: bool) -> None:
        self.name = name
        self.owner = owner

    def signal(self) -> None:
        raise NotImplementedError

    def wait(self, timeout_s: float) -> str:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class SemChannel(Channel):
    def __init__(self, name: str, owner: bool) -> None:
        super().__init__(name, owner)
        import posix_ipc

        self._busy = posix_ipc.BusyError
        self._sigerr = posix_ipc.SignalError
        self._ipc = posix_ipc
        names = (f"/{name}-ab", f"/{name}-ba")
        self._names = names
        self._sems: list[Any] = []
        flags = posix_ipc.O_CREX if owner else 0
        for n in names:
            self._sems.append(posix_ipc.Semaphore(n, flags, initial_value=0))
        self._tx, self._rx = (self._sems[0], self._sems[1]) if owner else (self._sems[1], self._sems[0])

    def signal(self) -> None:
        self._tx.release()

    def wait(self, timeout_s: float) -> str:
        try:
            self._rx.acquire(timeout_s)
        except (self._busy, self._sigerr):  # SignalError: EINTR, let the Python handler run next
            return "timeout"
        return "ok"

    def close(self) -> None:
        for s in self._sems:
            with contextlib.suppress(Exception):
                s.close()
        if self.owner:
            for n in self._names:
                with contextlib.suppress(self._ipc.ExistentialError):
                    self._ipc.unlink_semaphore(n)


class ZmqChannel(Channel):
    def __init__(self, name: str, owner: bool) -> None:
        super().__init__(name, owner)
        import zmq

        self._zmq = zmq
        self.path = os.path.join(TMPDIR, f"{name}.sock")
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDTIMEO, int(RT_BUDGET_S * 1000))
        if owner:
            self._sock.bind(f"ipc://{self.path}")
        else:
            self._sock.connect(f"ipc://{self.path}")

    def signal(self) -> None:
        self._sock.send(b"x")

    def wait(self, timeout_s: float) -> str:
        if self._sock.poll(int(timeout_s * 1000), self._zmq.POLLIN):
            self._sock.recv()
            return "ok"
        return "timeout"

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._sock.close(linger=0)
        with contextlib.suppress(Exception):
            self._ctx.term()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class FifoChannel(Channel):
    """Two FIFOs. Opening order avoids the blocking open(): A opens its read end before starting B,
    B opens its read end and then its write end (A's reader exists), B's first signal tells A that
    B's reader exists, and A opens its write end lazily on its first signal()."""

    def __init__(self, name: str, owner: bool) -> None:
        super().__init__(name, owner)
        self._paths = (os.path.join(TMPDIR, f"{name}.ab"), os.path.join(TMPDIR, f"{name}.ba"))
        self._tx_fd = -1
        self._rx_fd = -1
        if owner:
            for p in self._paths:
                os.mkfifo(p, 0o600)
            self._tx_path, rx_path = self._paths
            self._rx_fd = os.open(rx_path, os.O_RDONLY | os.O_NONBLOCK)
        else:
            rx_path, self._tx_path = self._paths
            self._rx_fd = os.open(rx_path, os.O_RDONLY | os.O_NONBLOCK)
            self._tx_fd = os.open(self._tx_path, os.O_WRONLY | os.O_NONBLOCK)
        self._ever_read = False

    def signal(self) -> None:
        if self._tx_fd < 0:
            self._tx_fd = os.open(self._tx_path, os.O_WRONLY | os.O_NONBLOCK)
        os.write(self._tx_fd, b"x")

    def wait(self, timeout_s: float) -> str:
        r, _, _ = select.select([self._rx_fd], [], [], timeout_s)
        if not r:
            return "timeout"
        try:
            data = os.read(self._rx_fd, 4096)
        except BlockingIOError:
            return "timeout"
        if data:
            self._ever_read = True
            return "ok"
        if not self._ever_read:  # no writer connected yet (start-up); not a death
            time.sleep(0.001)
            return "timeout"
        return "eof"  # all writers closed: the kernel closed the dead peer's write end

    def close(self) -> None:
        for fd in (self._tx_fd, self._rx_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if self.owner:
            for p in self._paths:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)


class SpinChannel(Channel):
    """Each side owns one 64-bit counter (on separate cache lines) and bumps it to signal; the
    other side spins until the counter changes. Deadline is checked every 256 polls."""

    def __init__(self, name: str, owner: bool) -> None:
        super().__init__(name, owner)
        import posix_ipc

        self._ipc = posix_ipc
        self._shm_name = f"/{name}-spin"
        if owner:
            shm = posix_ipc.SharedMemory(self._shm_name, posix_ipc.O_CREX, size=128)
        else:
            shm = posix_ipc.SharedMemory(self._shm_name)
        self._mm = mmap.mmap(shm.fd, 128)
        shm.close_fd()
        self._tx_off, self._rx_off = (0, 64) if owner else (64, 0)
        self._tx_seq = 0
        self._rx_seen = struct.unpack_from("<Q", self._mm, self._rx_off)[0]

    def signal(self) -> None:
        self._tx_seq += 1
        struct.pack_into("<Q", self._mm, self._tx_off, self._tx_seq)

    def wait(self, timeout_s: float) -> str:
        mm, off, seen, unpack = self._mm, self._rx_off, self._rx_seen, struct.unpack_from
        deadline = time.monotonic() + timeout_s
        while True:
            for _ in range(256):
                v = unpack("<Q", mm, off)[0]
                if v != seen:
                    self._rx_seen = v
                    return "ok"
            if time.monotonic() >= deadline:
                return "timeout"

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._mm.close()
        if self.owner:
            with contextlib.suppress(self._ipc.ExistentialError):
                self._ipc.unlink_shared_memory(self._shm_name)


class Iox2Channel(Channel):
    def __init__(self, name: str, owner: bool) -> None:
        super().__init__(name, owner)
        import iceoryx2 as iox2

        iox2.set_log_level(iox2.LogLevel.Error)
        self._iox2 = iox2
        node_name = f"{name}-{'a' if owner else 'b'}"
        self._node = (
            iox2.NodeBuilder.new()
            .name(iox2.NodeName.new(node_name))
            .signal_handling_mode(iox2.SignalHandlingMode.Disabled)
            .create(iox2.ServiceType.Ipc)
        )
        ab = self._node.service_builder(iox2.ServiceName.new(f"{name}-ab")).event().open_or_create()
        ba = self._node.service_builder(iox2.ServiceName.new(f"{name}-ba")).event().open_or_create()
        tx_svc, rx_svc = (ab, ba) if owner else (ba, ab)
        self._services = [ab, ba]
        self.stale_nodes_cleaned: int | None = None
        self._listener = rx_svc.listener_builder().create()
        self._notifier = tx_svc.notifier_builder().create()

    def signal(self) -> None:
        self._notifier.notify()

    def wait(self, timeout_s: float) -> str:
        got = self._listener.timed_wait(self._iox2.Duration.from_micros(max(1, int(timeout_s * 1e6))))
        return "ok" if got else "timeout"

    def close(self) -> None:
        for port in (self._notifier, self._listener):
            with contextlib.suppress(Exception):
                port.delete()
        self._services.clear()
        if self.owner:  # remove what a SIGKILLed peer node left behind (not done by the kernel)
            with contextlib.suppress(Exception):
                self.stale_nodes_cleaned = self._node.try_cleanup_dead_nodes().cleanups
        with contextlib.suppress(Exception):
            del self._node


CHANNELS: dict[str, type[Channel]] = {
    "sem": SemChannel,
    "zmq": ZmqChannel,
    "fifo": FifoChannel,
    "spin": SpinChannel,
    "iox2": Iox2Channel,
}


# --------------------------------------------------------------------------------------------
# peer (side B)
# --------------------------------------------------------------------------------------------


def _raise_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def peer_main(mech: str, name: str) -> int:
    """Open the channel by name, signal "ready", then answer every ping until told to stop."""
    signal.signal(signal.SIGTERM, _raise_exit)
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
    script = os.path.abspath(__file__)
    return subprocess.Popen([sys.executable, script, "--peer", mech, name], stdin=subprocess.DEVNULL)


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


# --------------------------------------------------------------------------------------------
# housekeeping
# --------------------------------------------------------------------------------------------


def _our_paths(pid: int | None = None) -> list[str]:
    stem = f"{PREFIX}{pid}-" if pid is not None else PREFIX
    pats = [f"/dev/shm/sem.{stem}*", f"/dev/shm/{stem}*", os.path.join(TMPDIR, f"{stem}*")]
    return sorted({p for pat in pats for p in glob.glob(pat)})


def sweep_stale() -> list[str]:
    """Remove mlt-bench-<pid>-* objects whose creating process no longer exists (e.g. SIGKILLed run)."""
    removed = []
    for path in _our_paths():
        m = re.search(rf"{PREFIX}(\d+)-", os.path.basename(path))
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
    return removed


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

    signal.signal(signal.SIGTERM, _raise_exit)  # so finally-blocks run on SIGTERM too
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
    leftovers = _our_paths(os.getpid())
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
