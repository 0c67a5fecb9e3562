"""The metrics port with pages of a service's own next to /metrics (the orchestrator's /debug/...).

prometheus_client's start_http_server serves metrics only; this is its WSGI app, wrapped. The extra
pages show what the server is running (batch sizes, step timings), so they follow the metrics port's
bind: on loopback (the default `--metrics-host`) any local user may read them, as /metrics; bound
beyond loopback they need the public API's bearer token, and are refused outright when the service
has none. /metrics itself stays open either way: it is what Prometheus scrapes.
"""

from __future__ import annotations

import hmac
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import make_server

import structlog
from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

from moe_lightning.service.auth import is_loopback

NO_TOKEN = (
    "the /debug pages are served beyond loopback only with the API's token: set --auth-token "
    "(MOE_LIGHTNING_AUTH_TOKEN), or keep --metrics-host on loopback"
)
WANT_TOKEN = "send 'Authorization: Bearer <token>' (the API's token)"


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
    expected = f"Bearer {token}".encode() if token else None
    log = structlog.get_logger()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        route = routes.get(path)
        if route is None:
            if path.startswith("/debug/"):
                return _answer(start_response, Page.text(404, f"no page {path}; there are: {', '.join(routes)}"))
            return metrics(environ, start_response)
        if exposed:
            got = environ.get("HTTP_AUTHORIZATION", "").encode()
            if expected is None:
                return _answer(start_response, Page.text(403, NO_TOKEN))
            if not hmac.compare_digest(got, expected):
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


def start_metrics_server(host: str, port: int, routes: Mapping[str, Route], token: str | None) -> tuple[Any, int]:
    """Serves /metrics and `routes` on host:port from a daemon thread, as start_http_server does;
    returns (the server, its port)."""

    class Server(ThreadingWSGIServer):
        pass

    # as prometheus_client picks it: an IPv6 host needs an AF_INET6 socket
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    Server.address_family = family
    app = make_app(routes, token, exposed=not is_loopback(host))
    httpd = make_server(sockaddr[0], port, app, Server, handler_class=_SilentHandler)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd, httpd.server_port
