"""`moe-lightning up`: the four services as separate OS processes on one box.

Internal services listen on unix sockets in a per-run directory of this user's only (mode 0700, a
fresh mkdtemp under $XDG_RUNTIME_DIR or the temp dir); only the orchestrator's API (and each
service's metrics port on loopback) is reachable. Stopping sends SIGTERM to the orchestrator first
(it drains), then to the workers, and finally sweeps any segment a killed process left. Each
service gets SIGTERM from the kernel too when the launching process dies (kill -9 included), so no
service outlives its launcher.
"""

from __future__ import annotations

import ctypes
import errno
import os
import queue
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from moe_lightning.service import names
from moe_lightning.service.upstream import health_status, open_channel, readiness_channel
from moe_lightning.shm.segment import list_segments, sweep_stale
from moe_lightning.spec import ModelSpec, resolve_dtype

SERVICES = {  # start order: (module run with -m, the gRPC service whose health says ready)
    "weight_store": ("services.weight_store", names.WEIGHT_STORE),
    "cpu_attention": ("services.cpu_attention", names.CPU_ATTENTION),
    "gpu_expert": ("services.gpu_expert", names.GPU_EXPERT),
    "orchestrator": ("orchestrator", names.GENERATION),
}


class StackError(RuntimeError):
    pass


class StackInterrupted(StackError):
    """Start-up given up because the caller asked to stop (SIGTERM or Ctrl-C on `up`)."""


def not_private(path: Path) -> str | None:
    """Why `path` is not a directory that only this user can use, or None if it is: a real directory
    (not a symbolic link), owned by our uid, no access for group or others."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "it does not exist"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & 0o077:
        return f"its mode is {stat.S_IMODE(st.st_mode):04o}: group or others have access (chmod 700 it)"
    return None


def runtime_root() -> Path:
    """Where private per-run directories go: $XDG_RUNTIME_DIR when it is set and ours, else the temp dir."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_absolute() and not_private(Path(xdg)) is None:
        return Path(xdg)
    return Path(tempfile.gettempdir())


def private_dir(path: Path | None = None, prefix: str = "moe-lightning-") -> Path:
    """A directory only this user can use. None: a new one (mkdtemp: an unpredictable name, mode 0700)
    under `runtime_root()`. A path: created with mode 0700 if missing; one that already exists is
    refused (StackError naming it and why) unless it is a real directory of ours with no group or
    other access, so that nobody else can plant a socket, a log file or a symbolic link in it."""
    if path is None:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=runtime_root()))
    path = Path(path)
    if not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    why = not_private(path)
    if why is not None:
        raise StackError(f"refusing to use {path} as a private directory: {why}")
    return path


def checked_log_dir(path: Path) -> Path:
    """A log directory given by the user: created 0700 if missing; an existing one must be a real
    directory (not a symbolic link) of ours that group and others cannot write to (reading is theirs
    to allow: it is the user's own directory)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    why = None
    if stat.S_ISLNK(st.st_mode):
        why = "it is a symbolic link (give the directory it points to)"
    elif not stat.S_ISDIR(st.st_mode):
        why = "it is not a directory"
    elif st.st_uid != os.getuid():
        why = f"it is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    elif st.st_mode & 0o022:
        why = f"its mode is {stat.S_IMODE(st.st_mode):04o}: group or others may write to it"
    if why is not None:
        raise StackError(f"refusing to write logs in {path}: {why}")
    return path


def open_log(path: Path) -> IO[bytes]:
    """Opens (creating with mode 0600) a log file for appending, never through a symbolic link, and
    only if it is a regular file of ours (not a FIFO that would block, nor someone else's file)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StackError(f"refusing to write the log {path}: it is a symbolic link") from None
        if exc.errno == errno.ENXIO:  # a FIFO with no reader
            raise StackError(f"refusing to write the log {path}: it is not a regular file") from None
        raise StackError(f"cannot open the log {path}: {exc.strerror}") from None
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = "it is not a regular file"
    elif st.st_uid != os.getuid():
        why = f"it is owned by uid {st.st_uid}, not by this user"
    if why is not None:
        os.close(fd)
        raise StackError(f"refusing to write the log {path}: {why}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "ab")


def _read_tail(path: Path, lines: int) -> list[str]:
    """The last lines of a log, read without following a symbolic link; [] if there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return []
        return f.read().decode(errors="replace").strip().splitlines()[-lines:]


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parent_death_hook(parent: int | None = None, sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` that has the kernel send `sig` to the child when its parent dies (Linux's
    PR_SET_PDEATHSIG), and ends the child at once if the parent (pid `parent`, default: this process)
    already died before the signal was armed. None where prctl is not available."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid() if parent is None else parent

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # reparented already: the signal will never come
            os._exit(1)

    return hook


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


_spawner = _Spawner()


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
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class StackConfig:
    model: Path
    run_id: str = "default"
    host: str = "127.0.0.1"
    port: int = 50051
    device: str = "cpu"
    device_memory: str | None = None
    device_kv_memory: str | None = None  # a KV cache in gpu_expert, so attention may run on the device
    attention_placement: str = "auto"  # cpu, gpu or auto (the HRM picks)
    experts_placement: str = "auto"  # gpu (streamed), cpu (computed where they live) or auto
    tls_cert: Path | None = None  # serve the public API over TLS (the other services stay on unix sockets)
    tls_key: Path | None = None
    tls_ca: Path | None = None  # verifies tls_cert in the readiness check (None: the cert itself, self-signed)
    auth_token: str | None = None  # require it as a bearer token (passed by environment, not argv)
    kv_cache_memory: str = "2GiB"
    kv_dtype: str = "auto"  # cpu_attention's KV cache: auto (the arena's dtype), float32, bfloat16, float16
    dtype: str = "auto"  # of the arena: auto resolves by the device (moe_lightning.spec.resolve_dtype)
    max_batch_size: int | None = None  # None: the orchestrator's HRM policy decides
    micro_batch_size: int | None = None
    cache_dir: Path | None = None
    threads: dict[str, int] = field(default_factory=dict)  # torch threads per service
    log_dir: Path | None = None  # None: services log to this process's stderr
    run_dir: Path | None = None  # the unix sockets' directory; None: a fresh private one per start
    extra: dict[str, list[str]] = field(default_factory=dict)  # more flags per service


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.run_dir: Path | None = None  # made by prepare(): see StackConfig.run_dir
        self._made_run_dir = False
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.addresses: dict[str, str] = {}
        self.metrics_ports: dict[str, int] = {}
        self._logs: list[IO[bytes]] = []
        self._env: dict[str, str] = {}
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self.restarts: dict[str, list[float]] = {name: [] for name in SERVICES}  # monotonic restart times
        self.gave_up: list[str] = []  # services in a crash loop, left down

    @property
    def api_address(self) -> str:
        return self.addresses["orchestrator"]

    def weight_dtype(self) -> str:
        """The arena's dtype for this stack's device (the weight store alone cannot know gpu_expert's)."""
        c = self.config
        try:
            return resolve_dtype(c.dtype, ModelSpec.from_pretrained(c.model).dtype, c.device)
        except (OSError, ValueError):
            return c.dtype  # an unreadable checkpoint: the weight store says what is wrong with it

    def _args(self, name: str) -> list[str]:
        c = self.config
        a = self.addresses
        common = ["--address", a[name], "--metrics-port", str(self.metrics_ports[name]), "--run-id", c.run_id]
        if c.threads.get(name):
            common += ["--threads", str(c.threads[name])]
        if name == "weight_store":
            own = ["--model", str(c.model), "--dtype", self.weight_dtype(), "--no-progress"]
            own += ["--cache-dir", str(c.cache_dir)] if c.cache_dir else []
        elif name == "cpu_attention":
            own = [
                "--weight-store",
                a["weight_store"],
                "--kv-cache-memory",
                c.kv_cache_memory,
                "--kv-dtype",
                c.kv_dtype,
            ]
        elif name == "gpu_expert":
            own = ["--weight-store", a["weight_store"], "--device", c.device]
            own += ["--device-memory", c.device_memory] if c.device_memory else []
            own += ["--device-kv-memory", c.device_kv_memory] if c.device_kv_memory else []
        else:
            own = [
                "--weight-store",
                a["weight_store"],
                "--gpu-expert",
                a["gpu_expert"],
                "--cpu-attention",
                a["cpu_attention"],
            ]
            own += ["--max-batch-size", str(c.max_batch_size)] if c.max_batch_size is not None else []
            own += ["--micro-batch-size", str(c.micro_batch_size)] if c.micro_batch_size is not None else []
            own += ["--attention-placement", c.attention_placement, "--experts-placement", c.experts_placement]
            if c.tls_cert is not None and c.tls_key is not None:
                own += ["--tls-cert", str(c.tls_cert), "--tls-key", str(c.tls_key)]
        return common + own + c.extra.get(name, [])

    def start(self, timeout: float = 600.0, stop: threading.Event | None = None) -> None:
        """Starts all four and waits for SERVING; on any failure stops what did start, then raises.
        `stop` set while waiting gives up the start (StackInterrupted) after stopping what started."""
        try:
            self.prepare()
            self.spawn(list(SERVICES))
            self.wait_ready(timeout, stop)
        except BaseException:
            self.stop()
            raise

    def prepare(self) -> None:
        """Sweeps a dead run's leftovers, makes the private run directory and picks every address and
        port; a public port that something already listens on is an error here, named."""
        c = self.config
        if c.port and port_in_use(c.host, c.port):
            raise StackError(
                f"{c.host}:{c.port} is already in use: another moe-lightning stack (or a service left over "
                "from one) or another program listens there; stop it or pick another --port"
            )
        for name in sweep_stale(c.run_id):
            sys.stderr.write(f"swept stale segment {name}\n")
        if self.run_dir is None:
            self.run_dir = private_dir(c.run_dir, prefix=f"moe-lightning-{c.run_id}-")
            self._made_run_dir = c.run_dir is None
        for name in SERVICES:
            if name == "orchestrator":
                self.addresses[name] = f"{c.host}:{c.port or free_port(c.host)}"
            else:
                sock = self.run_dir / f"{name}.sock"
                if len(os.fsencode(sock)) > 107:  # sun_path is 108 bytes with its NUL
                    raise StackError(f"{sock}: too long for a unix socket path (set TMPDIR to a shorter dir)")
                sock.unlink(missing_ok=True)
                self.addresses[name] = f"unix://{sock}"
            self.metrics_ports[name] = free_port()

    def spawn(self, names: list[str]) -> None:
        """Starts these services' processes (in any order: each waits for what it needs)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # Two processes computing on shared cores: torch's spinning OpenMP workers would steal each
        # other's cores for milliseconds at every hand-off.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self._env = env
        for name in names:
            self._spawn(name, env)

    def _spawn(self, name: str, env: dict[str, str]) -> None:
        module = SERVICES[name][0]
        out: IO[bytes] | None = None
        if self.config.log_dir is not None:
            out = open_log(checked_log_dir(self.config.log_dir) / f"{name}.log")
            self._logs.append(out)
        if name == "orchestrator" and self.config.auth_token:
            env = {**env, "MOE_LIGHTNING_AUTH_TOKEN": self.config.auth_token}  # not in argv: ps shows argv
        argv = [sys.executable, "-m", module, *self._args(name)]

        def popen() -> None:  # recorded by the spawner thread: a caller interrupted meanwhile still stops it
            self.procs[name] = subprocess.Popen(
                argv,
                env=env,
                stdout=out,
                stderr=out,
                start_new_session=True,  # Ctrl-C reaches us only; we stop the services in order
                preexec_fn=parent_death_hook(),  # and they get SIGTERM when we die, even by kill -9
            )

        _spawner.run(popen)

    def wait_ready(self, timeout: float, stop: threading.Event | None = None) -> None:
        deadline = time.monotonic() + timeout
        channels = {name: open_channel(addr) for name, addr in self.addresses.items()}
        if self.config.tls_cert is not None:  # the public API speaks TLS: so must its health check
            channels["orchestrator"].close()
            channels["orchestrator"] = readiness_channel(
                self.addresses["orchestrator"], self.config.tls_cert, self.config.tls_ca
            )
        try:
            pending = set(SERVICES)
            while pending:
                for name in list(pending):
                    if stop is not None and stop.is_set():
                        waiting = ", ".join(sorted(pending))
                        raise StackInterrupted(f"asked to stop during start-up; not SERVING: {waiting}")
                    code = self.procs[name].poll()
                    if code is not None:
                        raise StackError(f"{name} exited with code {code} during start-up{self._log_hint(name)}")
                    if health_status(channels[name], SERVICES[name][1], timeout=0.5) == 1:
                        pending.discard(name)
                if time.monotonic() > deadline:
                    raise StackError(f"not SERVING after {timeout:.0f} s: {', '.join(sorted(pending))}")
                time.sleep(0.1)
        finally:
            for ch in channels.values():
                ch.close()

    def _log_hint(self, name: str) -> str:
        if self.config.log_dir is None:
            return " (see its log above)"
        path = self.config.log_dir / f"{name}.log"
        return f"; last log lines of {path}:\n" + "\n".join(_read_tail(path, 5))

    def endpoints(self) -> dict[str, dict[str, str]]:
        return {
            name: {
                "grpc": self.addresses[name],
                "metrics": f"http://127.0.0.1:{self.metrics_ports[name]}/metrics",
                "pid": str(self.procs[name].pid) if name in self.procs else "",
            }
            for name in SERVICES
        }

    def supervise(self, max_restarts: int = 5, window: float = 60.0) -> None:
        """Restarts any service that exits while the stack runs (kill -9, a crash, the OOM killer),
        with the same address and flags: the orchestrator re-wires the workers, the weight store
        adopts the arena the workers still map. More than `max_restarts` of one service within `window`
        seconds is a crash loop: it is left down and named in `gave_up`."""

        def loop() -> None:
            while not self._stopping.wait(0.2):
                for name, proc in list(self.procs.items()):
                    code = proc.poll()
                    if code is None or self._stopping.is_set() or name in self.gave_up:
                        continue
                    now = time.monotonic()
                    recent = [t for t in self.restarts[name] if now - t < window]
                    if len(recent) >= max_restarts:
                        self.gave_up.append(name)
                        sys.stderr.write(f"moe-lightning: {name} keeps exiting (code {code}); not restarting it\n")
                        continue
                    self.restarts[name].append(now)
                    sys.stderr.write(f"moe-lightning: {name} exited with code {code}; restarting it\n")
                    if name != "orchestrator" and self.run_dir is not None:
                        (self.run_dir / f"{name}.sock").unlink(missing_ok=True)
                    self._spawn(name, self._env)

        self._supervisor = threading.Thread(target=loop, name="stack-supervisor", daemon=True)
        self._supervisor.start()

    def stop(self, timeout: float = 30.0) -> list[str]:
        """SIGTERM in order (orchestrator first so it drains), SIGKILL after `timeout`; returns leaks swept."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        for name in reversed(list(SERVICES)):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for f in self._logs:
            f.close()
        self._logs.clear()
        swept = sweep_stale(self.config.run_id)
        if self.run_dir is not None:
            for name in SERVICES:
                if name != "orchestrator":
                    (self.run_dir / f"{name}.sock").unlink(missing_ok=True)
            if self._made_run_dir:
                try:
                    self.run_dir.rmdir()
                except OSError:
                    pass  # something else put there: left as it is
            self.run_dir = None
        return swept

    def leaked_segments(self) -> list[str]:
        return list_segments(self.config.run_id)

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
