"""gateway: the OpenAI-compatible HTTP API (FastAPI on uvicorn) in front of the orchestrator's gRPC
API. It keeps no state of its own: each HTTP request becomes gRPC calls (docs/openai.md)."""

from __future__ import annotations

import asyncio
import resource
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog
import uvicorn
from fastapi import FastAPI
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.app import REQUESTS, Settings, create_app
from gateway.errors import ApiError, bad_request, from_http
from gateway.upstream import Upstream
from moe_lightning.config.flag import EnvDefaultsParser
from moe_lightning.config.gateway import OPEN_PER_SERVED, GatewayConfig
from moe_lightning.service.auth import is_loopback
from moe_lightning.service.logs import configure_logging


def build_parser() -> EnvDefaultsParser:
    p = EnvDefaultsParser(prog="moe-lightning-gateway", description=__doc__)
    GatewayConfig.add_cli_args(p)
    return p


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"--address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with what it lacks in front of the ASGI app, which sees a request
    only once its headers are in:

    - a deadline on each request's line and headers (`header_timeout` s, from the connection's start
      or from the first byte of a request after the last; 408, then closed). uvicorn's only timeout
      is keep-alive's between requests, and every byte resets it: a client that sent nothing, or a
      byte every few seconds, held its connection as long as it liked;
    - a bound on their size (`max_header_bytes`; 431): llhttp keeps no limit of its own, and one
      200 MB header was buffered whole;
    - at most `max_connections` requests in progress at once, GET /health and /metrics aside (503 in
      OpenAI's shape; uvicorn's limit_concurrency answers plain text, and counts connections that have
      not sent their headers yet, so a client trickling headers on that many sockets would shut
      everyone else out), and at most OPEN_PER_SERVED times as many connections open, idle or in
      their headers, before a new one is closed at once (each is held `header_timeout` s at most:
      what bounds descriptors);
    - uvicorn's 400 for what is not HTTP in OpenAI's shape too.

    A subclass made per configuration (`protocol_class`) holds the three limits."""

    header_timeout: float = 10.0
    max_header_bytes: int = 64 << 10
    max_connections: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._awaiting_head = True  # between requests, or within a request's line and headers
        self._head_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.max_connections is not None and len(self.connections) > OPEN_PER_SERVED * self.max_connections:
            self._refuse(_too_many())
            return
        self._arm()  # a client that connects and sends nothing

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head:
            # a request's first bytes: its headers' clock starts (idle keep-alive until then is
            # uvicorn's own timeout, which this data just cancelled)
            if self._deadline is None:
                self._arm()
            self._head_bytes += len(data)
        super().data_received(data)
        if self._awaiting_head and self._head_bytes > self.max_header_bytes and not self.transport.is_closing():
            if self.cycle is not None and not self.cycle.response_complete:
                # a pipelined head while the last answer still goes out: read no more until it is done
                # (uvicorn resumes reading then, and this check answers)
                self.flow.pause_reading()
            else:
                message = f"the request line and headers are over {self.max_header_bytes} bytes"
                self._refuse(from_http(431, message, "headers_too_large"))

    def on_headers_complete(self) -> None:
        self._disarm()
        self._awaiting_head, self._head_bytes = False, 0
        busy = self.max_connections is not None and len(self.tasks) >= self.max_connections
        if not busy or self._probe():
            return super().on_headers_complete()
        # uvicorn answers the request it has no room for with the app on self.app, for this request
        app, self.app = self.app, _busy
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def _probe(self) -> bool:
        """A GET of /health or /metrics: answered whatever is in progress, as a liveness probe must be
        (at the limit /health answered 503, and a probe would restart a gateway that was only busy).
        Each is cheap and bodiless; the open-connection bound still holds them."""
        return self.parser.get_method() == b"GET" and self.url.split(b"?", 1)[0] in PROBES

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._awaiting_head = True  # what comes next on this connection is the next request's head

    def send_400_response(self, msg: str) -> None:
        self._refuse(bad_request(f"not an HTTP/1.1 request: {msg}"))

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or not self._awaiting_head:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # the next request's first bytes came while the last one's answer still goes out: its
            # headers may wait for that answer (the connection is busy, not idle)
            self._arm()
            return
        message = f"the request's headers did not arrive within {self.header_timeout:g} s"
        self._refuse(from_http(408, message, "request_timeout"))

    def _refuse(self, error: ApiError) -> None:
        """An answer of the protocol's own, before any route runs: counted as _Guard counts the app's."""
        self._disarm()
        self.transport.write(error.raw(self.server_state.default_headers))
        self.transport.close()
        REQUESTS.labels("other", str(error.status)).inc()


PROBES = (b"/health", b"/metrics")  # exempt from --max-connections (GuardedProtocol._probe)


def _too_many() -> ApiError:
    headers = {"Connection": "close", "Retry-After": "1"}
    return from_http(503, "the server has as many requests as it serves at once: retry shortly", headers=headers)


async def _busy(scope: Scope, receive: Receive, send: Send) -> None:
    """The answer to a request beyond --max-connections (then the connection closes); _Guard does not
    see it, so it is counted here."""
    REQUESTS.labels("other", "503").inc()
    await _too_many().response()(scope, receive, send)


def protocol_class(header_timeout: float, max_header_bytes: int, max_connections: int | None) -> type[GuardedProtocol]:
    """GuardedProtocol with these limits (uvicorn makes a protocol per connection from a class)."""
    limits = dict(header_timeout=header_timeout, max_header_bytes=max_header_bytes, max_connections=max_connections)
    return type("GatewayProtocol", (GuardedProtocol,), limits)


def uvicorn_config(app: FastAPI, config: GatewayConfig, host: str, port: int) -> uvicorn.Config:
    """How the gateway serves `app`, with the limits `config` sets."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol_class(config.header_timeout, config.max_header_bytes, config.max_connections),
        ssl_certfile=str(config.tls_cert) if config.tls_cert else None,
        ssl_keyfile=str(config.tls_key) if config.tls_key else None,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
    )


async def _serve(config: GatewayConfig, host: str, port: int) -> None:
    log = structlog.get_logger()
    upstream = Upstream(config.api, config.api_tls_ca, config.auth_token)
    try:
        info = await upstream.model_info(config.start_timeout)
        name = config.served_model_name or Path(info.model_path).name or info.architecture
        settings = Settings(
            name, info.max_position_embeddings, config.auth_token, config.max_body_bytes, config.body_timeout
        )
        server = uvicorn.Server(uvicorn_config(create_app(settings, upstream), config, host, port))
        log.info("serving", address=f"{host}:{port}", api=config.api, model=name, tls=bool(config.tls_cert))
        await server.serve()
    finally:
        await upstream.close()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when it is installed (as uvicorn itself picks it, and vLLM serves on it): the event
    loop's own cost is paid per streamed event (docs/openai.md "Overhead")."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _raise_open_files(wanted: int) -> None:
    """The soft limit on descriptors up to what --max-connections may open (the hard limit at most):
    at the common soft limit of 1024, connections held in their headers would run the process out of
    descriptors before any limit of ours answered."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def main(argv: Sequence[str] | None = None) -> int:
    config = GatewayConfig.from_cli_args(build_parser().parse_args(argv))
    log = configure_logging("gateway", config.log_level, config.log_json or None)
    _raise_open_files(OPEN_PER_SERVED * config.max_connections + 256)  # + the gRPC channel, logs, ...
    host, port = split_address(config.address)
    if bool(config.tls_cert) != bool(config.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    if not is_loopback(host) and not config.auth_token and not config.insecure:
        log.error("startup_failed", error=f"{host} is beyond this machine and there is no --auth-token")
        return 1
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_serve(config, host, port))
    except Exception as exc:  # the API never answered, a port in use, a bad certificate
        log.error("startup_failed", error=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
