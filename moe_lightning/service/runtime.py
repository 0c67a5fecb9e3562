"""Service bootstrap: gRPC server with health and reflection, Prometheus port, graceful SIGTERM;
`serve`, the life of a service process around its own start-up work.

Health has two names: "" (live: the process answers) and the service's own name (ready: SERVING
only once its weights are mapped and warm-up is done). SIGTERM flips both to NOT_SERVING, stops
accepting, lets in-flight calls finish within the grace period, then runs the clean-up hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_lightning.config.service import ServiceConfig

import signal
import threading
from collections.abc import Callable, Mapping
from concurrent import futures
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from moe_lightning.service.errors import ErrorMappingInterceptor
from moe_lightning.service.limits import MAX_MESSAGE_BYTES
from moe_lightning.service.main_thread import MainThreadWork
from moe_lightning.service.metrics import SERVING
from moe_lightning.service.metrics_http import Route, start_metrics_server


def server_options(max_receive_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Every gRPC server's options, threaded or asyncio."""
    return [
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),  # a port in use is an error, not shared with an orphan holding it
    ]


def bind(
    server: Any,
    address: str,
    credentials: grpc.ServerCredentials | None,
    metrics_port: int | None,
    metrics_host: str,
    pages: Mapping[str, Route] | None = None,
    pages_token: str | None = None,
) -> tuple[int, int | None]:
    """Binds a gRPC server (threaded or asyncio) to `address`, over TLS when given `credentials`, and
    starts the Prometheus port, with `pages` of the service's own beside /metrics (metrics_http.py:
    beyond loopback they need `pages_token`); returns (the gRPC port, the metrics port or None).
    Pages or not, the port is metrics_http's server, not prometheus_client's start_http_server: that
    one gives every connection a thread with no timeout, so slow clients could hold them all."""
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if metrics_port is None:
        return port, None
    _, bound = start_metrics_server(metrics_host, metrics_port, pages or {}, pages_token)
    return port, bound


class ServiceHooks:
    """What the threaded and the asyncio runtime (aio_runtime.py) share: the services the server
    carries (reflection lists them) and the drain and shutdown hooks."""

    server: Any

    def __init__(self) -> None:
        self._service_names = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        self._cleanups: list[Callable[[], None]] = []
        self._before_drain: list[Callable[[], None]] = []

    def add_service(self, add_fn: Callable[[Any, Any], None], servicer: Any, full_name: str) -> None:
        add_fn(servicer, self.server)
        self._service_names.append(full_name)

    def on_shutdown(self, fn: Callable[[], None]) -> None:
        """Runs after the server stopped (clean-up of segments, threads)."""
        self._cleanups.append(fn)

    def on_drain(self, fn: Callable[[], None]) -> None:
        """Runs when shutdown starts, before in-flight calls are waited for."""
        self._before_drain.append(fn)


class ServiceRuntime(ServiceHooks):
    def __init__(
        self,
        name: str,
        address: str,
        metrics_port: int | None,
        metrics_host: str = "127.0.0.1",
        max_workers: int = 16,
        grace_seconds: float = 10.0,
        server_credentials: grpc.ServerCredentials | None = None,
        interceptors: tuple[grpc.ServerInterceptor, ...] = (),
    ) -> None:
        super().__init__()
        self.name = name
        self.grace_seconds = grace_seconds
        self.log = structlog.get_logger()
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"{name}-rpc"),
            interceptors=(*interceptors, ErrorMappingInterceptor()),
            options=server_options(),
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.address = address
        self.port, self.metrics_port = bind(self.server, address, server_credentials, metrics_port, metrics_host)
        self._stopping = threading.Event()
        self.main_thread = MainThreadWork()  # what handlers hand to the main thread (main_thread.py)
        self.set_serving(False)

    def set_serving(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set(self.name, status)
        SERVING.set(1 if ready and not self.stopping else 0)
        live = health_pb2.HealthCheckResponse.NOT_SERVING if self.stopping else health_pb2.HealthCheckResponse.SERVING
        self.health.set("", live)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def start(self) -> None:
        reflection.enable_server_reflection(self._service_names, self.server)
        self.server.start()
        signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=self.stop, daemon=True).start())
        signal.signal(signal.SIGINT, lambda *_: threading.Thread(target=self.stop, daemon=True).start())
        self.log.info("service_started", address=self.address, port=self.port, metrics_port=self.metrics_port)

    def stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        try:
            self.log.info("service_stopping", grace_seconds=self.grace_seconds)
            self.health.enter_graceful_shutdown()
            SERVING.set(0)
            for fn in self._before_drain:
                _safe(fn, self.log)
            self.server.stop(self.grace_seconds).wait()
            for fn in reversed(self._cleanups):
                _safe(fn, self.log)
            self.log.info("service_stopped")
        finally:  # whatever failed above, the main thread returns from wait() and the process ends
            self.main_thread.close()

    def wait(self) -> None:
        """Runs the work handed to the main thread until stop() has finished."""
        self.main_thread.serve()


def _safe(fn: Callable[[], None], log: Any) -> None:
    try:
        fn()
    except Exception:
        log.exception("shutdown_hook_failed", hook=getattr(fn, "__name__", repr(fn)))


def prepare_process(
    config: ServiceConfig, owner: str, service: str, keep_segments: tuple[str, ...] = ()
) -> tuple[Any, grpc.ServerCredentials | None, tuple[grpc.ServerInterceptor, ...]]:
    """What every service main does before its server exists, threaded or asyncio: logging, torch
    threads, the internal secret it sends and (an internal service) checks (auth.internal_guard: one
    on TCP without a secret exits here), sweeping a dead predecessor's segments (but those named in
    `keep_segments`, which the service may adopt), and the public API's TLS credentials. Returns the
    logger, the credentials and the internal-secret interceptors."""
    from moe_lightning.service.auth import internal_guard
    from moe_lightning.service.logs import configure_logging
    from moe_lightning.shm.segment import sweep_stale

    log = configure_logging(owner, config.log_level, config.log_json or None)
    guard = internal_guard(config, service)
    threads = getattr(config, "threads", 0)
    if threads > 0:
        import torch

        torch.set_num_threads(threads)
    for name in sweep_stale(config.run_id, owner=owner, at_startup=True, keep=keep_segments):
        log.warning("swept_stale_segment", name=name)
    credentials = None
    if getattr(config, "tls_cert", None) or getattr(config, "tls_key", None):
        from moe_lightning.service.auth import server_credentials

        if not (config.tls_cert and config.tls_key):
            raise SystemExit("--tls-cert and --tls-key go together")
        credentials = server_credentials(config.tls_cert, config.tls_key)
    return log, credentials, guard


def bootstrap(
    config: ServiceConfig,
    owner: str,
    service: str,
    add_fn: Callable[[Any, grpc.Server], None],
    servicer: Any,
    grace_seconds: float = 10.0,
    keep_segments: tuple[str, ...] = (),
    max_workers: int = 16,
) -> tuple[Any, ServiceRuntime]:
    """`prepare_process`, then a started (live, not yet ready) gRPC server with `servicer` registered."""
    log, credentials, interceptors = prepare_process(config, owner, service, keep_segments)
    if getattr(config, "auth_token", None):
        from moe_lightning.service.auth import BearerTokenInterceptor

        interceptors = (*interceptors, BearerTokenInterceptor(config.auth_token))
    runtime = ServiceRuntime(
        service,
        config.address,
        config.metrics_port,
        config.metrics_host,
        max_workers=max_workers,
        grace_seconds=grace_seconds,
        server_credentials=credentials,
        interceptors=interceptors,
    )
    runtime.add_service(add_fn, servicer, service)
    runtime.start()
    return log, runtime


def serve(
    config: ServiceConfig,
    owner: str,
    service: str,
    add_fn: Callable[[Any, grpc.Server], None],
    servicer: Any,
    build: Callable[[ServiceRuntime], Mapping[str, Any]],
    *,
    failures: tuple[type[Exception], ...] = (Exception,),
    grace_seconds: float = 10.0,
    keep_segments: tuple[str, ...] = (),
    max_workers: int = 16,
) -> int:
    """A service main's whole life; returns its exit code.

    The gRPC server goes live (health NOT_SERVING) before `build` runs, so peers and probes can tell
    "starting" from "down" while weights load. `build(runtime)` does the service's start-up work:
    it registers its own clean-up hooks as it creates what they release (a hook registered before a
    step that may fail still runs when it does), makes `servicer` ready, and returns the fields of
    the `serving` log line. An exception of `failures` from it is a start-up failure: logged as
    `startup_failed`, the runtime stopped (hooks run), exit code 1, or EXIT_NO_SHARED_MEMORY when it
    was /dev/shm that was short (shm/pages.py: `up` retries that one with back-off). Others propagate,
    traceback and all.
    """
    from moe_lightning.shm.pages import EXIT_NO_SHARED_MEMORY, shortage

    log, runtime = bootstrap(
        config,
        owner,
        service,
        add_fn,
        servicer,
        grace_seconds=grace_seconds,
        keep_segments=keep_segments,
        max_workers=max_workers,
    )
    try:
        serving = build(runtime)
    except failures as exc:
        log.error("startup_failed", error=str(exc))
        runtime.stop()
        return EXIT_NO_SHARED_MEMORY if shortage(exc) is not None else 1
    runtime.set_serving(True)
    log.info("serving", **serving)
    runtime.wait()
    return 0
