"""Service processes that die with their launcher, and the ports they may bind.

The kernel sends the parent-death signal (PR_SET_PDEATHSIG) when the *thread* that forked a child
ends, so every service is forked from one long-lived thread; a port held by an orphan of an
earlier stack is detected before anything starts (gRPC binds without SO_REUSEPORT).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import queue
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from moe_lightning.private_paths import UnsafePathError, private_dir, runtime_root


def with_parent_death(argv: Sequence[str], parent: int | None = None, sig: int = signal.SIGTERM) -> list[str]:
    """`argv` behind an exec wrapper (parent_death.py) that has the kernel send `sig` to the child
    when its parent dies (Linux's PR_SET_PDEATHSIG), and ends the child at once if the parent (pid
    `parent`, default: this process) died before the signal was armed. The wrapper, not a
    `preexec_fn`, arms it: see parent_death.py for why. `argv` unchanged where prctl does not exist."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    parent = os.getpid() if parent is None else parent
    return [sys.executable, "-S", "-I", str(_WRAPPER), str(parent), str(int(sig)), *argv]


_WRAPPER = Path(__file__).with_name("parent_death.py")


class _Spawner:
    """Forks every service from one thread that lives as long as the process. The kernel sends the
    parent-death signal when the *thread* that forked a child ends, not the process: a service
    restarted by the supervisor thread would otherwise get SIGTERM when that thread stops."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def run(self, fn: Callable[[], Any]) -> Any:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # not started, or we are a fork
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._loop, args=(self._jobs,), daemon=True)
                self._thread.name = "moe-lightning-spawner"
                self._thread.start()
            done: Future[Any] = Future()
            self._jobs.put((fn, done))
        return done.result()

    @staticmethod
    def _loop(jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]]) -> None:
        while True:
            fn, done = jobs.get()
            try:
                done.set_result(fn())
            except BaseException as exc:
                done.set_exception(exc)


spawner = _Spawner()  # the one thread every service is forked from


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on host:port (binding with SO_REUSEADDR, as gRPC does: only a
    listener, not a connection in TIME_WAIT, makes that fail)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False  # the orchestrator says what is wrong with the address
    for family, kind, proto, _, addr in infos[:1]:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as exc:
                return exc.errno == errno.EADDRINUSE
    return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a child to bind soon after. Taken below the kernel's ephemeral range when
    there is room: a port the kernel hands out (bind to 0) is also what it gives any process's
    outgoing connection as its local port, so in the moment before the child binds, another
    connection (gloo's, gRPC's) may take it (a CI run failed so: "Address already in use")."""
    low = _ephemeral_low()
    for port in random.sample(range(max(1024, low - 12288), low), 64) if low > 11264 else ():
        if port in _GIVEN:  # handed out a moment ago, perhaps not bound yet
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        if not _claim(port):  # another of our processes (a second stack: Ray's nodes on one box) has it
            continue
        _GIVEN.append(port)
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_GIVEN: collections.deque[int] = collections.deque(maxlen=256)
CLAIM_SECONDS = 120.0  # a claimed port is not handed out again by any of our processes for this long


def _claim(port: int) -> bool:
    """Claims `port` for this user's processes on this machine: two launchers (two Ray node stacks on
    one box) picking ports at once can otherwise both get one before either child binds it (a CI run:
    "Address already in use"). A file per port in a directory only we can use; an old claim lapses.
    True (no claim needed) where that directory cannot be had safely: the bind check still stands."""
    try:
        claims = private_dir(runtime_root() / f"moe-lightning-ports-{os.getuid()}")
    except (UnsafePathError, OSError):
        return True
    path = claims / str(port)
    now = time.time()
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        try:
            if now - path.stat().st_mtime < CLAIM_SECONDS:
                return False
            os.utime(path)  # lapsed: ours now (two taking one lapsed claim in the same instant is left to chance)
            return True
        except OSError:
            return False
    except OSError:
        return True
    os.close(fd)
    if random.random() < 1 / 64:  # now and then, lapsed claims go
        for old in claims.iterdir():
            with contextlib.suppress(OSError):
                if now - old.stat().st_mtime > CLAIM_SECONDS:
                    old.unlink()
    return True


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # not Linux: the kernel's choice
