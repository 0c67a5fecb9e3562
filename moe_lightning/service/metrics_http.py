"""The metrics port with pages of a service's own next to /metrics (the orchestrator's /debug/...).

prometheus_client's start_http_server serves metrics only; this is its WSGI app, wrapped. The extra
pages show what the server is running (batch sizes, step timings), so they follow the metrics port's
bind: on loopback (the default `--metrics-host`) any local user may read them, as /metrics; bound
beyond loopback they need the public API's bearer token, and are refused outright when the service
has none. /metrics itself stays open either way: it is what Prometheus scrapes.

Every service's metrics port is this server, pages or not. It is a thread per connection, so it
bounds both: a request's line and headers must arrive within `header_timeout` seconds (a client
that sends nothing, or a byte every few seconds, held a thread for as long as it liked), and at most
`max_connections` are served at once (beyond that, a 503 at once).
"""

from __future__ import annotations

import io
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import make_server

import structlog
from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

from moe_lightning.service.auth import bearer_matches, is_loopback

NO_TOKEN = (
    "the /debug pages are served beyond loopback only with the API's token: set --auth-token "
    "(MOE_LIGHTNING_AUTH_TOKEN), or keep --metrics-host on loopback"
)
WANT_TOKEN = "send 'Authorization: Bearer <token>' (the API's token)"
HEADER_TIMEOUT = 10.0  # seconds for a request's line and headers
WRITE_TIMEOUT = 30.0  # seconds for the answer to go out to a client that reads slowly
MAX_CONNECTIONS = 256  # threads serving at once: room for scrapers and a burst of slow clients, not a thread bomb
BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: 20\r\n"
    b"Retry-After: 1\r\nConnection: close\r\n\r\ntoo many connections"
)


@dataclass(frozen=True, slots=True)
class Page:
    status: int
    content_type: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def text(cls, status: int, message: str, headers: dict[str, str] | None = None) -> Page:
        return cls(status, "text/plain; charset=utf-8", (message + "\n").encode(), headers or {})


# A page's handler: the query string's parameters in, the answer out.
Route = Callable[[Mapping[str, list[str]]], Page]


def make_app(routes: Mapping[str, Route], token: str | None, exposed: bool) -> Callable[..., Iterable[bytes]]:
    """The WSGI app: `routes` by path, anything else to Prometheus' app. `exposed`: bound beyond
    loopback, so the routes need `token` (and are refused without one)."""
    metrics = make_wsgi_app()
    log = structlog.get_logger()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        route = routes.get(path)
        if route is None:
            if path.startswith("/debug/"):
                pages = ", ".join(routes) or "none"
                return _answer(start_response, Page.text(404, f"no page {path}; there are: {pages}"))
            return metrics(environ, start_response)
        if exposed:
            if token is None:
                return _answer(start_response, Page.text(403, NO_TOKEN))
            # WSGI gives header values as latin-1 strings: back to the bytes the client sent
            got = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
            if not bearer_matches(got, token):
                return _answer(start_response, Page.text(401, WANT_TOKEN, {"WWW-Authenticate": "Bearer"}))
        try:
            page = route(parse_qs(environ.get("QUERY_STRING", "")))
        except Exception as exc:  # a page's bug must not take the metrics port down
            log.exception("debug_page_failed", path=path)
            page = Page.text(500, f"{path} failed: {exc!r}")
        return _answer(start_response, page)

    return app


def _answer(start_response: Callable[..., Any], page: Page) -> list[bytes]:
    headers = {"Content-Type": page.content_type, "Content-Length": str(len(page.body)), "Cache-Control": "no-store"}
    start_response(f"{page.status} {HTTPStatus(page.status).phrase}", list((headers | page.headers).items()))
    return [page.body]


class _DeadlineReader(io.RawIOBase):
    """A socket's reads with one deadline for all of them: a timeout per read alone would let a client
    that sends a byte every few seconds take forever over its headers."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request took too long to arrive")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class _Handler(_SilentHandler):
    """prometheus_client's handler, with a deadline on the request's line and headers and a timeout on
    writing the answer."""

    header_timeout = HEADER_TIMEOUT

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the plain reader setup() made: replaced by one with the deadline
        self._reader = _DeadlineReader(self.connection, time.monotonic() + self.header_timeout)
        self.rfile = io.BufferedReader(self._reader)

    def parse_request(self) -> bool:
        ok = super().parse_request()
        # the headers are in: what remains (a body, the answer) gets the write timeout instead
        self._reader.deadline = time.monotonic() + WRITE_TIMEOUT
        self.connection.settimeout(WRITE_TIMEOUT)
        return ok

    def handle(self) -> None:
        try:
            super().handle()
        except (TimeoutError, ConnectionError):
            self.close_connection = True  # a client too slow or gone: nothing to answer, nothing to log


class _Server(ThreadingWSGIServer):
    """A thread per connection, as prometheus_client's, but at most as many as `slots` has."""

    slots: threading.BoundedSemaphore
    request_queue_size = 1024  # socketserver's 5 dropped the SYNs of a burst (each retried a second later)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            # all threads busy: answer this one from the accepting thread, which must not wait on it
            try:
                request.setblocking(False)
                request.send(BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()  # no thread started to release it
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def start_metrics_server(
    host: str,
    port: int,
    routes: Mapping[str, Route],
    token: str | None,
    *,
    header_timeout: float = HEADER_TIMEOUT,
    max_connections: int = MAX_CONNECTIONS,
) -> tuple[Any, int]:
    """Serves /metrics and `routes` on host:port from a daemon thread, as start_http_server does, with
    `header_timeout` seconds for a request's headers and at most `max_connections` served at once;
    returns (the server, its port)."""

    class Server(_Server):
        pass

    class Handler(_Handler):
        pass

    Handler.header_timeout = header_timeout
    Server.slots = threading.BoundedSemaphore(max_connections)
    # as prometheus_client picks it: an IPv6 host needs an AF_INET6 socket
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    Server.address_family = family
    app = make_app(routes, token, exposed=not is_loopback(host))
    httpd = make_server(sockaddr[0], port, app, Server, handler_class=Handler)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd, httpd.server_port
