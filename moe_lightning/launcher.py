"""`moe-lightning up`: the five processes (four with no HTTP gateway) as separate OS processes on one box.

Internal services listen on unix sockets in a per-run directory of this user's only (mode 0700, a
fresh mkdtemp under $XDG_RUNTIME_DIR or the temp dir); only the orchestrator's API and the gateway's
HTTP port (and each service's metrics port on loopback) are reachable. Before anything is spawned
the config's own refusals run (config/checks.py). Stopping sends SIGTERM to the gateway, then the
orchestrator (it drains), then the workers, and finally sweeps any segment a killed process left. Each
service gets SIGTERM from the kernel too when the launching process dies (kill -9 included), so no
service outlives its launcher.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from moe_lightning.children import free_port, port_in_use, spawner, with_parent_death
from moe_lightning.config.checks import StackCheck, check_stack
from moe_lightning.config.stack import INTERNAL, SERVICE_NAMES, StackConfig, Wiring
from moe_lightning.private_paths import UnsafePathError, checked_log_dir, open_log, private_dir, read_tail
from moe_lightning.service import names
from moe_lightning.service.upstream import POLLING_OPTIONS, health_status, http_ready, open_channel, readiness_channel
from moe_lightning.shm.pages import EXIT_NO_SHARED_MEMORY
from moe_lightning.shm.segment import list_segments, sweep_stale
from moe_lightning.spec import ModelSpec, resolve_dtype

SHM_RETRY_FIRST = 1.0  # s: the first wait of a service whose start found /dev/shm full, doubling ...
SHM_RETRY_MAX = 30.0  # ... up to this; a run of them ends after SHM_RETRY_RESET s without one
SHM_RETRY_RESET = 300.0
SHM_MESSAGE = re.compile(r"/dev/shm has [^\"]*? needs [\d.]+ \w+")
OMP_SPIN_COUNT = 30_000  # libgomp's spins before a worker sleeps (its default, unbounded under ACTIVE)


@dataclass(frozen=True)
class ServiceProcess:
    """How the launcher runs one service: its module, how it says it is ready, where it listens."""

    module: str  # run with -m
    health: str | None  # the gRPC service whose health says ready; None: HTTP, ready when GET /health is 200
    public_port: Callable[[StackConfig], int | None] | None = None  # on the API's host; None: a unix socket
    metrics: bool = True  # a metrics port of its own (the gateway serves /metrics on its HTTP port)
    auth_token: bool = False  # gets the public API's token (by environment: ps shows argv)


SERVICES = {  # in start order (config.stack.SERVICE_NAMES); the gateway only with StackConfig.http_port
    "weight_store": ServiceProcess("services.weight_store", names.WEIGHT_STORE),
    "cpu_attention": ServiceProcess("services.cpu_attention", names.CPU_ATTENTION),
    "gpu_expert": ServiceProcess("services.gpu_expert", names.GPU_EXPERT),
    "orchestrator": ServiceProcess("orchestrator", names.GENERATION, lambda c: c.port, auth_token=True),
    "gateway": ServiceProcess("gateway", None, lambda c: c.http_port, metrics=False, auth_token=True),
}
assert tuple(SERVICES) == SERVICE_NAMES


class StackError(RuntimeError):
    pass


class StackInterrupted(StackError):
    """Start-up given up because the caller asked to stop (SIGTERM or Ctrl-C on `up`)."""


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
        self.shm_waits: dict[str, list[float]] = {name: [] for name in SERVICES}  # starts short of /dev/shm
        self._shm_retry_at: dict[str, float] = {}  # when a service waiting for shared memory starts again

    @property
    def api_address(self) -> str:
        return self.addresses["orchestrator"]

    @property
    def services(self) -> list[str]:
        """This stack's services in start order: the four, and the HTTP gateway when it has a port."""
        return self.config.services

    @property
    def http_address(self) -> str:
        """The gateway's base URL (http_port set)."""
        scheme = "https" if self.config.tls_cert is not None else "http"
        return f"{scheme}://{self.addresses['gateway']}"

    def weight_dtype(self) -> str:
        """The arena's dtype for this stack's device (the weight store alone cannot know gpu_expert's)."""
        c = self.config
        try:
            return resolve_dtype(c.dtype, ModelSpec.from_pretrained(c.model).dtype, c.device)
        except (OSError, ValueError):
            return c.dtype  # an unreadable checkpoint: the weight store says what is wrong with it

    def _args(self, name: str) -> list[str]:
        wiring = Wiring(self.addresses, self.metrics_ports, self.weight_dtype())
        return self.config.argv(wiring)[name] + self.config.extra.get(name, [])

    def check(self) -> StackCheck:
        """The start-up refusals that need no process (config.checks), before any is spawned: the
        message the service would give, in well under a second instead of after its start."""
        try:
            return check_stack(self.config)
        except (OSError, ValueError) as exc:
            raise StackError(f"refused before start: {exc}") from None

    def start(self, timeout: float = 600.0, stop: threading.Event | None = None) -> None:
        """Starts this stack's services and waits for SERVING; on any failure stops what did start, then raises.
        `stop` set while waiting gives up the start (StackInterrupted) after stopping what started."""
        try:
            self.prepare()  # the public ports first: one in use is the likelier mistake, and names itself
            for note in self.check().notes:
                sys.stderr.write(f"moe-lightning: {note}\n")
            self.spawn(self.services)
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
            try:
                self.run_dir = private_dir(c.run_dir, prefix=f"moe-lightning-{c.run_id}-")
            except UnsafePathError as exc:
                raise StackError(str(exc)) from None
            self._made_run_dir = c.run_dir is None
        if c.http_port and port_in_use(c.host, c.http_port):
            raise StackError(f"{c.host}:{c.http_port} (--http-port) is already in use: pick another port")
        for name in self.services:
            kind = SERVICES[name]
            self.metrics_ports[name] = free_port() if kind.metrics else 0
            if kind.public_port is not None:
                self.addresses[name] = f"{c.host}:{kind.public_port(c) or free_port(c.host)}"
            else:
                sock = self.run_dir / f"{name}.sock"
                if len(os.fsencode(sock)) > 107:  # sun_path is 108 bytes with its NUL
                    raise StackError(f"{sock}: too long for a unix socket path (set TMPDIR to a shorter dir)")
                sock.unlink(missing_ok=True)
                self.addresses[name] = f"unix://{sock}"

    def spawn(self, names: list[str]) -> None:
        """Starts these services' processes (in any order: each waits for what it needs)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # Processes computing on shared cores (docs/operations.md, "Threads"): OpenMP workers that spin
        # without end would steal each other's cores at every hand-off, and workers that never spin
        # (PASSIVE) pay a sleep and a wake-up at each of a step's ~800 parallel regions (a CPU decode
        # step of the bench model at 64 sequences, int4 experts: 310 tok/s PASSIVE, 337 with this spin).
        # A short spin, and ACTIVE so that libgomp keeps it when threads outnumber cores.
        if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
            env.update(OMP_WAIT_POLICY="ACTIVE", GOMP_SPINCOUNT=str(OMP_SPIN_COUNT))
        self._env = env
        for name in names:
            self._spawn(name, env)

    def _spawn(self, name: str, env: dict[str, str]) -> None:
        module = SERVICES[name].module
        out: IO[bytes] | None = None
        if self.config.log_dir is not None:
            try:
                out = open_log(checked_log_dir(self.config.log_dir) / f"{name}.log")
            except UnsafePathError as exc:
                raise StackError(str(exc)) from None
            self._logs.append(out)
        if SERVICES[name].auth_token and self.config.auth_token:
            env = {**env, "MOE_LIGHTNING_AUTH_TOKEN": self.config.auth_token}  # not in argv: ps shows argv
        argv = [sys.executable, "-m", module, *self._args(name)]

        def popen() -> None:  # recorded by the spawner thread: a caller interrupted meanwhile still stops it
            self.procs[name] = subprocess.Popen(
                with_parent_death(argv),  # they get SIGTERM when we die, even by kill -9
                env=env,
                stdout=out,
                stderr=out,
                start_new_session=True,  # Ctrl-C reaches us only; we stop the services in order
            )

        spawner.run(popen)

    def wait_ready(self, timeout: float, stop: threading.Event | None = None) -> None:
        deadline = time.monotonic() + timeout
        grpc_services = [name for name in self.addresses if SERVICES[name].health is not None]
        channels = {name: open_channel(self.addresses[name], options=POLLING_OPTIONS) for name in grpc_services}
        if self.config.tls_cert is not None:  # the public API speaks TLS: so must its health check
            channels["orchestrator"].close()
            channels["orchestrator"] = readiness_channel(
                self.addresses["orchestrator"], self.config.tls_cert, self.config.tls_ca
            )
        try:
            pending = set(self.services)
            while pending:
                for name in list(pending):
                    if stop is not None and stop.is_set():
                        waiting = ", ".join(sorted(pending))
                        raise StackInterrupted(f"asked to stop during start-up; not SERVING: {waiting}")
                    code = self.procs[name].poll()
                    if code is not None:
                        why = " (too little shared memory)" if code == EXIT_NO_SHARED_MEMORY else ""
                        raise StackError(f"{name} exited with code {code}{why} during start-up{self._log_hint(name)}")
                    health = SERVICES[name].health
                    if health is None:
                        if http_ready(self.http_address, self.config.tls_ca or self.config.tls_cert):
                            pending.discard(name)
                    elif health_status(channels[name], health, timeout=0.5) == 1:
                        pending.discard(name)
                if time.monotonic() > deadline:
                    hints = "".join(self._log_hint(name) for name in sorted(pending))
                    raise StackError(f"not SERVING after {timeout:.0f} s: {', '.join(sorted(pending))}{hints}")
                time.sleep(0.1)
        finally:
            for ch in channels.values():
                ch.close()

    def _log_hint(self, name: str) -> str:
        if self.config.log_dir is None:
            return " (see its log above)"
        path = self.config.log_dir / f"{name}.log"
        return f"; last log lines of {path}:\n" + "\n".join(read_tail(path, 5))

    def endpoints(self) -> dict[str, dict[str, str]]:
        def where(name: str) -> dict[str, str]:
            if not SERVICES[name].metrics:  # the gateway: its /metrics on its own HTTP port
                return {"http": self.http_address, "metrics": f"{self.http_address}/metrics"}
            return {"grpc": self.addresses[name], "metrics": f"http://127.0.0.1:{self.metrics_ports[name]}/metrics"}

        return {
            name: {
                **where(name),
                "pid": str(self.procs[name].pid) if name in self.procs else "",
            }
            for name in self.services
        }

    def supervise(self, max_restarts: int = 5, window: float = 60.0) -> None:
        """Restarts any service that exits while the stack runs (kill -9, a crash, the OOM killer),
        with the same address and flags: the orchestrator re-wires the workers, the weight store
        adopts the arena the workers still map. More than `max_restarts` of one service within `window`
        seconds is a crash loop: it is left down and named in `gave_up`. A start that failed for want
        of shared memory (EXIT_NO_SHARED_MEMORY: another user filled /dev/shm) is no crash: it is
        tried again after a back-off (SHM_RETRY_FIRST, doubling to SHM_RETRY_MAX) for as long as it
        takes, so the stack serves again once the space is back."""

        def loop() -> None:
            while not self._stopping.wait(0.2):
                for name, proc in list(self.procs.items()):
                    code = proc.poll()
                    if code is None or self._stopping.is_set() or name in self.gave_up:
                        continue
                    now = time.monotonic()
                    if code == EXIT_NO_SHARED_MEMORY:
                        if self._shm_retry(name, now):
                            self._spawn(name, self._env)
                        continue
                    recent = [t for t in self.restarts[name] if now - t < window]
                    if len(recent) >= max_restarts:
                        self.gave_up.append(name)
                        sys.stderr.write(f"moe-lightning: {name} keeps exiting (code {code}); not restarting it\n")
                        continue
                    self.restarts[name].append(now)
                    sys.stderr.write(f"moe-lightning: {name} exited with code {code}; restarting it\n")
                    if name in INTERNAL and self.run_dir is not None:
                        (self.run_dir / f"{name}.sock").unlink(missing_ok=True)
                    self._spawn(name, self._env)

        self._supervisor = threading.Thread(target=loop, name="stack-supervisor", daemon=True)
        self._supervisor.start()

    def _shm_retry(self, name: str, now: float) -> bool:
        """For a service that exited wanting shared memory: whether its back-off is over (start it
        again now); on first sight, says why and when, once."""
        at = self._shm_retry_at.get(name)
        if at is None:
            waits = [t for t in self.shm_waits[name] if now - t < SHM_RETRY_RESET]
            waits.append(now)
            self.shm_waits[name] = waits
            delay = min(SHM_RETRY_MAX, SHM_RETRY_FIRST * 2 ** (len(waits) - 1))
            self._shm_retry_at[name] = now + delay
            sys.stderr.write(
                f"moe-lightning: {name} could not get shared memory{self._shm_reason(name)}; "
                f"starting it again in {delay:.0f} s (not a crash: it waits for /dev/shm to have room)\n"
            )
            return False
        if now < at:
            return False
        del self._shm_retry_at[name]
        if name in INTERNAL and self.run_dir is not None:
            (self.run_dir / f"{name}.sock").unlink(missing_ok=True)
        return True

    def _shm_reason(self, name: str) -> str:
        """The service's own words on it ("/dev/shm has N free, ... needs M"), from its log's tail."""
        if self.config.log_dir is None:
            return " (see its log)"
        for line in reversed(read_tail(self.config.log_dir / f"{name}.log", 5)):
            found = SHM_MESSAGE.search(line)
            if found:
                return f" ({found[0]})"
        return ""

    def stop(self, timeout: float = 30.0) -> list[str]:
        """SIGTERM in order (the gateway, then the orchestrator so it drains, then the workers together),
        SIGKILL after `timeout`; returns leaks swept."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        # the API's front first, each drained before the next; then the workers, which no request
        # reaches any more, all at once (each takes ~0.6 s to exit: one after another was 2 s a stack)
        fronts = [n for n in ("gateway", "orchestrator") if n in self.services]
        for group in [[n] for n in fronts] + [[n for n in reversed(self.services) if n not in fronts]]:
            procs = [p for p in (self.procs.get(n) for n in group) if p is not None and p.poll() is None]
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for proc in procs:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for f in self._logs:
            f.close()
        self._logs.clear()
        swept = sweep_stale(self.config.run_id)
        if self.run_dir is not None:
            for name in INTERNAL:
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
