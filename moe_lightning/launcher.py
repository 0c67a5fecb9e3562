"""`moe-lightning up`: the four services as separate OS processes on one box.

Internal services listen on unix sockets in a per-run directory of this user's only (mode 0700, a
fresh mkdtemp under $XDG_RUNTIME_DIR or the temp dir); only the orchestrator's API (and each
service's metrics port on loopback) is reachable. Stopping sends SIGTERM to the orchestrator first
(it drains), then to the workers, and finally sweeps any segment a killed process left. Each
service gets SIGTERM from the kernel too when the launching process dies (kill -9 included), so no
service outlives its launcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from moe_lightning.children import free_port, port_in_use, spawner, with_parent_death
from moe_lightning.private_paths import UnsafePathError, checked_log_dir, open_log, private_dir, read_tail
from moe_lightning.service import names
from moe_lightning.service.auth import is_loopback
from moe_lightning.service.upstream import POLLING_OPTIONS, health_status, http_ready, open_channel, readiness_channel
from moe_lightning.shm.segment import list_segments, sweep_stale
from moe_lightning.spec import ModelSpec, resolve_dtype

SERVICES = {  # start order: (module run with -m, the gRPC service whose health says ready)
    "weight_store": ("services.weight_store", names.WEIGHT_STORE),
    "cpu_attention": ("services.cpu_attention", names.CPU_ATTENTION),
    "gpu_expert": ("services.gpu_expert", names.GPU_EXPERT),
    "orchestrator": ("orchestrator", names.GENERATION),
    "gateway": ("gateway", ""),  # HTTP: ready when GET /health answers 200; only with StackConfig.http_port
}


class StackError(RuntimeError):
    pass


class StackInterrupted(StackError):
    """Start-up given up because the caller asked to stop (SIGTERM or Ctrl-C on `up`)."""


@dataclass
class StackConfig:
    model: Path
    run_id: str = "default"
    host: str = "127.0.0.1"
    port: int = 50051
    device: str = "cpu"
    gpus: int = 1  # gpu_expert's tensor-parallel ranks (one process per device; docs/parallel.md)
    device_memory: str | None = None  # per device
    device_kv_memory: str | None = None  # a KV cache in gpu_expert, so attention may run on the device
    link_bandwidth: float | None = None  # bytes/s: a simulated link for a CPU device (gpu_expert --link-bandwidth)
    attention_placement: str = "auto"  # cpu, gpu or auto (the HRM picks)
    experts_placement: str = "auto"  # gpu (streamed), cpu (computed where they live) or auto
    http_port: int | None = None  # the OpenAI-compatible gateway's port on `host` (0: any free); None: no gateway
    chat_template: Path | None = None  # the orchestrator's --chat-template
    stream_interval: int = 1  # the orchestrator's --stream-interval: tokens per streamed message
    tls_cert: Path | None = None  # serve the public API over TLS (the other services stay on unix sockets)
    tls_key: Path | None = None
    tls_ca: Path | None = None  # verifies tls_cert in the readiness check (None: the cert itself, self-signed)
    auth_token: str | None = None  # require it as a bearer token (passed by environment, not argv)
    kv_cache_memory: str = "2GiB"
    kv_dtype: str = "auto"  # cpu_attention's KV cache: auto (the arena's dtype), float32, bfloat16, float16
    dtype: str = "auto"  # of the arena: auto resolves by the device (moe_lightning.spec.resolve_dtype)
    quantize: str = "auto"  # the expert pages' format: auto (the checkpoint's), none, int8, int4
    quantize_group_size: int = 128
    expert_kernels: str = "fastest"  # gpu_expert's quantized kernels: fastest (measured) or exact
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

    @property
    def services(self) -> list[str]:
        """This stack's services in start order: the four, and the HTTP gateway when it has a port."""
        return [n for n in SERVICES if n != "gateway" or self.config.http_port is not None]

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
        c = self.config
        a = self.addresses
        if name == "gateway":
            return self._gateway_args() + c.extra.get(name, [])
        common = ["--address", a[name], "--metrics-port", str(self.metrics_ports[name]), "--run-id", c.run_id]
        if c.threads.get(name):
            common += ["--threads", str(c.threads[name])]
        if name == "weight_store":
            own = ["--model", str(c.model), "--dtype", self.weight_dtype(), "--no-progress"]
            own += ["--quantize", c.quantize, "--quantize-group-size", str(c.quantize_group_size)]
            own += ["--tensor-parallel", str(c.gpus)] if c.gpus > 1 else []
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
            own = ["--weight-store", a["weight_store"], "--device", c.device, "--expert-kernels", c.expert_kernels]
            own += ["--experts-placement", c.experts_placement]  # what it warms up at start (worker.py)
            own += ["--gpus", str(c.gpus)] if c.gpus > 1 else []
            own += ["--device-memory", c.device_memory] if c.device_memory else []
            own += ["--device-kv-memory", c.device_kv_memory] if c.device_kv_memory else []
            own += ["--link-bandwidth", repr(float(c.link_bandwidth))] if c.link_bandwidth is not None else []
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
            own += ["--chat-template", str(c.chat_template)] if c.chat_template else []
            own += ["--stream-interval", str(c.stream_interval)] if c.stream_interval != 1 else []
            if c.tls_cert is not None and c.tls_key is not None:
                own += ["--tls-cert", str(c.tls_cert), "--tls-key", str(c.tls_key)]
        return common + own + c.extra.get(name, [])

    def _gateway_args(self) -> list[str]:
        """The HTTP gateway: on the API's host, over the API (its token by environment, its TLS)."""
        c = self.config
        own = ["--address", self.addresses["gateway"], "--api", self.addresses["orchestrator"]]
        if c.tls_cert is not None and c.tls_key is not None:
            own += ["--tls-cert", str(c.tls_cert), "--tls-key", str(c.tls_key)]
            own += ["--api-tls-ca", str(c.tls_ca or c.tls_cert)]
        if not c.auth_token and not is_loopback(c.host):
            own += ["--insecure"]  # `up` refused this unless the user said --insecure
        return own

    def start(self, timeout: float = 600.0, stop: threading.Event | None = None) -> None:
        """Starts all four and waits for SERVING; on any failure stops what did start, then raises.
        `stop` set while waiting gives up the start (StackInterrupted) after stopping what started."""
        try:
            self.prepare()
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
            self.metrics_ports[name] = 0 if name == "gateway" else free_port()
            if name == "gateway":
                self.addresses[name] = f"{c.host}:{c.http_port or free_port(c.host)}"
            elif name == "orchestrator":
                self.addresses[name] = f"{c.host}:{c.port or free_port(c.host)}"
            else:
                sock = self.run_dir / f"{name}.sock"
                if len(os.fsencode(sock)) > 107:  # sun_path is 108 bytes with its NUL
                    raise StackError(f"{sock}: too long for a unix socket path (set TMPDIR to a shorter dir)")
                sock.unlink(missing_ok=True)
                self.addresses[name] = f"unix://{sock}"

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
            try:
                out = open_log(checked_log_dir(self.config.log_dir) / f"{name}.log")
            except UnsafePathError as exc:
                raise StackError(str(exc)) from None
            self._logs.append(out)
        if name in ("orchestrator", "gateway") and self.config.auth_token:
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
        grpc_services = [name for name in self.addresses if name != "gateway"]
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
                        raise StackError(f"{name} exited with code {code} during start-up{self._log_hint(name)}")
                    if name == "gateway":
                        if http_ready(self.http_address, self.config.tls_ca or self.config.tls_cert):
                            pending.discard(name)
                    elif health_status(channels[name], SERVICES[name][1], timeout=0.5) == 1:
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
            if name == "gateway":
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
            for name in SERVICES:
                if name not in ("orchestrator", "gateway"):
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
