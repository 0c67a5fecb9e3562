"""Issue 27, items 2, 9, 10 and 11 (part): the HTTP edge under clients that misbehave. A body over the
limit in any framing is a 413 before it is read; every error is in OpenAI's shape; slow headers are
cut off after a deadline, on the gateway and on the metrics ports, and connections are bounded;
GET /v1/models/{id}; the bearer scheme in any case. One stack (with a token and short timeouts) for
what needs the real gateway process; in-process gateways (real uvicorn, real app, the stack's API)
for a limit of their own. Real clients throughout: httpx, urllib, grpc and raw sockets."""

from __future__ import annotations

import asyncio
import json
import selectors
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import structlog
import uvicorn
from fastapi import FastAPI
from prometheus_client import REGISTRY

from gateway import server as gateway_server
from gateway.app import Settings, create_app
from gateway.server import OPEN_PER_SERVED
from gateway.upstream import Upstream
from moe_lightning.api.generation.v1 import generation_pb2, generation_pb2_grpc
from moe_lightning.config.gateway import GatewayConfig
from moe_lightning.launcher import Stack
from moe_lightning.service import auth, metrics_http

TOKEN = "hardening-s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
HEADER_TIMEOUT = 1.0  # the stack's gateway's --header-timeout
BODY_TIMEOUT = 2.0  # its --body-timeout
LIMIT = 8 << 20  # its --max-body-bytes (the default)
SLOW_CLIENTS = 200


@pytest.fixture(scope="module")
def stack(make_module_stack: Callable[..., Stack], tiny_model: Path) -> Stack:
    gateway = ["--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT)]
    return make_module_stack(model=tiny_model, http_port=0, auth_token=TOKEN, extra={"gateway": gateway})


@pytest.fixture(scope="module")
def model_id(stack: Stack) -> str:
    return stack.config.model.name


def _address(stack: Stack) -> tuple[str, int]:
    host, _, port = stack.addresses["gateway"].rpartition(":")
    return host, int(port)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


class _PeakRss:
    """The most a process's RSS grew over its value at the start, sampled every 5 ms."""

    def __init__(self, pid: int) -> None:
        self.pid, self.start, self.peak = pid, _rss_kib(pid), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_kib(self.pid))

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_kib(self.pid))

    @property
    def growth_mib(self) -> float:
        return (self.peak - self.start) / 1024


class _Flood:
    """Sends `head`, then `piece` again and again (up to `total` bytes) from a thread, as fast as the
    server takes it, until the server stops taking it; reads what comes back meanwhile."""

    def __init__(self, address: tuple[str, int], head: bytes, piece: bytes, total: int) -> None:
        self.sock = socket.create_connection(address, timeout=10)
        self.head, self.piece, self.total = head, piece, total
        self.sent = 0
        self.received = b""
        self.started = time.monotonic()
        self.first_answer_s: float | None = None
        self._sender = threading.Thread(target=self._send, daemon=True)

    def _send(self) -> None:
        try:
            self.sock.sendall(self.head)
            while self.sent < self.total:
                self.sock.sendall(self.piece)
                self.sent += len(self.piece)
        except OSError:
            pass  # the server closed: what the test wants

    def run(self, timeout: float = 20.0) -> _Flood:
        self._sender.start()
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                self.sock.settimeout(max(0.01, deadline - time.monotonic()))
                data = self.sock.recv(65536)
                if not data:
                    break
                if self.first_answer_s is None:
                    self.first_answer_s = time.monotonic() - self.started
                self.received += data
        except OSError:
            pass  # a reset after the answer: it was read already
        self.sock.close()
        self._sender.join(10)
        return self


def _answers(raw: bytes) -> list[tuple[int, dict[str, str], Any]]:
    """The HTTP/1.1 responses in `raw`, in order: (status, headers, the JSON body)."""
    out = []
    while raw.startswith(b"HTTP/1.1 "):
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        size = int(headers["content-length"])
        out.append((int(lines[0].split()[1]), headers, json.loads(rest[:size])))
        raw = rest[size:]
    return out


def _measured(what: str, flood: _Flood, rss: _PeakRss) -> None:
    first = f"{flood.first_answer_s:.3f}" if flood.first_answer_s is not None else "never"
    print(f"MEASURE {what}: answered after {first} s, {flood.sent >> 20} MiB sent, gateway +{rss.growth_mib:.1f} MiB")


def _openai_error(body: Any) -> dict[str, Any]:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# -- item 2: the body limit in every framing ---------------------------------------------------------


def test_a_chunked_body_over_the_limit_is_a_413_before_it_is_read(stack: Stack) -> None:
    """200 MB chunked: the gateway counts as it reads and stops at 8 MiB (it used to read it all,
    +580 MB, and answer 429)."""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    piece = b"%x\r\n" % (1 << 20) + b"[" * (1 << 20) + b"\r\n"
    with _PeakRss(stack.procs["gateway"].pid) as rss:
        flood = _Flood(_address(stack), head, piece, 200 << 20).run()
    _measured("chunked 200 MB", flood, rss)
    (status, headers, body), *_ = _answers(flood.received)
    assert status == 413 and _openai_error(body)["type"] == "invalid_request_error"
    assert headers["connection"] == "close"
    assert flood.first_answer_s is not None and flood.first_answer_s < 3.0
    assert flood.sent < 64 << 20  # stopped long before the 200 MB were sent
    assert rss.growth_mib < 48


def test_a_content_length_that_lies_does_not_get_past(stack: Stack, model_id: str) -> None:
    """A Content-Length smaller than what follows: the parser cuts the body at it and reads the rest
    as the next request, whose head is bounded like any (--max-header-bytes: 431), not buffered
    whole; and a Content-Length beside chunked framing is refused outright."""
    body = b"{}"  # the body the Content-Length claims; then 64 MB of "next request"
    head = (
        (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body
        + b"GET /"
    )
    with _PeakRss(stack.procs["gateway"].pid) as rss:
        flood = _Flood(_address(stack), head, b"a" * (1 << 20), 64 << 20).run()
    answers = _answers(flood.received)
    _measured(f"lying content-length {[a[0] for a in answers]}", flood, rss)
    assert [a[0] for a in answers] == [400, 431], answers
    assert all(_openai_error(b) for _, _, b in answers)
    assert flood.sent < 32 << 20 and rss.growth_mib < 48

    both = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 4\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    flood = _Flood(_address(stack), both, b"%x\r\n" % (1 << 20) + b"a" * (1 << 20) + b"\r\n", 16 << 20).run()
    (status, _, error), *_ = _answers(flood.received)
    assert status == 400 and _openai_error(error)["type"] == "invalid_request_error"


def test_a_body_that_stops_coming_is_a_408(stack: Stack) -> None:
    sock = socket.create_connection(_address(stack), timeout=10)
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{"model":'.encode()
    )
    started = time.monotonic()
    raw = b""
    while chunk := sock.recv(65536):
        raw += chunk
    waited = time.monotonic() - started
    sock.close()
    print(f"MEASURE body timeout: 408 after {waited:.2f} s")
    (status, headers, body), *_ = _answers(raw)
    assert status == 408 and _openai_error(body)["code"] == "request_timeout"
    assert headers["connection"] == "close" and BODY_TIMEOUT - 0.2 < waited < BODY_TIMEOUT + 2


# -- item 9: every error in OpenAI's shape -------------------------------------------------------------


def test_deeply_nested_json_is_a_400(stack: Stack, model_id: str) -> None:
    url = f"{stack.http_address}/v1/completions"
    headers = {**AUTH, "content-type": "application/json"}
    deep = b"[" * 100_000 + b"]" * 100_000
    inside = b'{"model": "%s", "prompt": %s}' % (model_id.encode(), deep)
    for content in (deep, inside):
        started = time.monotonic()
        r = httpx.post(url, content=content, headers=headers, timeout=30)
        assert r.status_code == 400 and time.monotonic() - started < 5
        assert "nested too deeply" in _openai_error(r.json())["message"]


def test_invalid_utf8_and_invalid_json_are_400s(stack: Stack, model_id: str) -> None:
    url = f"{stack.http_address}/v1/completions"
    headers = {**AUTH, "content-type": "application/json"}
    r = httpx.post(url, content=b'{"model": "%s", "prompt": "\xff\xfe"}' % model_id.encode(), headers=headers)
    assert r.status_code == 400 and "UTF-8" in _openai_error(r.json())["message"]
    r = httpx.post(url, content=b'{"model":', headers=headers)
    error = _openai_error(r.json())
    assert r.status_code == 400 and "not valid JSON" in error["message"] and error["param"] is None


def test_unknown_routes_and_methods_are_openai_errors(stack: Stack) -> None:
    for path in ("/v1/nope", "/nope"):
        r = httpx.get(f"{stack.http_address}{path}", headers=AUTH)
        error = _openai_error(r.json())
        assert r.status_code == 404 and error["type"] == "not_found_error" and path in error["message"]
    r = httpx.delete(f"{stack.http_address}/v1/completions", headers=AUTH)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert _openai_error(r.json())["code"] == "method_not_allowed"


@contextmanager
def _gateway_in_process(api: str, *argv: str, routes: Callable[[FastAPI], None] | None = None) -> Iterator[str]:
    """A gateway in this process (the real app on a real uvicorn, configured as gateway/server.py does
    from `argv`) over the stack's API; yields its base URL."""
    args = GatewayConfig.from_cli_args(gateway_server.build_parser().parse_args(["--api", api, *argv]))
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        upstream = Upstream(api, None, args.auth_token)
        settings = Settings("tiny", 128, args.auth_token, args.max_body_bytes, args.body_timeout)
        app = create_app(settings, upstream)
        if routes is not None:
            routes(app)
        server = box["server"] = uvicorn.Server(gateway_server.uvicorn_config(app, args, "127.0.0.1", 0))
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        box["port"] = server.servers[0].sockets[0].getsockname()[1]
        ready.set()
        await task
        await upstream.close()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(30), "the in-process gateway did not start"
    try:
        yield f"http://127.0.0.1:{box['port']}"
    finally:
        box["server"].should_exit = True
        thread.join(15)


def test_a_fault_of_ours_is_a_500_in_openai_shape_without_a_traceback(stack: Stack) -> None:
    secret = "/srv/moe-lightning/secret_module.py"

    def routes(app: FastAPI) -> None:
        @app.get("/v1/boom")
        async def boom() -> None:
            raise RuntimeError(f"failed reading {secret}")

    with structlog.testing.capture_logs() as logs, _gateway_in_process(stack.api_address, routes=routes) as url:
        r = httpx.get(f"{url}/v1/boom")
        after = httpx.get(f"{url}/health")  # the server is none the worse
    error = _openai_error(r.json())
    assert r.status_code == 500 and error["type"] == "internal_error"
    assert secret not in r.text and "Traceback" not in r.text and "RuntimeError" not in r.text
    assert any(e["event"] == "request_failed" and e.get("exc_info") for e in logs)  # the log has it all
    assert after.status_code == 200


# -- item 10: slow headers and bounded connections ------------------------------------------------------


def _slow_clients(address: tuple[str, int], n: int, seconds: float, meanwhile: Callable[[], None]) -> list[Any]:
    """`n` slowloris connections to `address`: half send a request line and then a header byte every
    0.3 s, half send nothing. Calls `meanwhile` 0.3 s after they opened. Returns, per connection, (seconds
    until the server closed it or None, what it answered)."""
    socks, opened_at = [], []
    for _ in range(n):
        socks.append(socket.create_connection(address, timeout=10))
        opened_at.append(time.monotonic())  # the deadline runs from each one's own start
    opened = time.monotonic()
    trickling = set(range(0, n, 2))
    for i in trickling:
        socks[i].sendall(b"GET /health HTTP/1.1\r\n")
    closed: dict[int, float] = {}
    answers = {i: b"" for i in range(n)}
    sel = selectors.DefaultSelector()
    for i, s in enumerate(socks):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
    called = False
    next_byte = opened + 0.3
    try:
        while len(closed) < n and time.monotonic() - opened < seconds:
            if not called and time.monotonic() - opened > 0.3:  # while they are held, one byte in
                meanwhile()
                called = True
            if time.monotonic() >= next_byte:
                for i in trickling - closed.keys():
                    try:
                        socks[i].send(b"a")
                    except OSError:
                        pass
                next_byte += 0.3
            for key, _ in sel.select(timeout=0.05):
                i = key.data
                try:
                    data = socks[i].recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                answers[i] += data
                if not data:
                    closed[i] = time.monotonic() - opened_at[i]
                    sel.unregister(socks[i])
    finally:
        sel.close()
        for s in socks:
            s.close()
    return [(closed.get(i), answers[i]) for i in range(n)]


def _timed_get(url: str, **kw: Any) -> tuple[int, float]:
    started = time.monotonic()
    r = httpx.get(url, timeout=5, **kw)
    return r.status_code, time.monotonic() - started


def test_slow_headers_on_the_gateway_are_cut_off_while_it_answers(stack: Stack) -> None:
    health: list[tuple[int, float]] = []
    result = _slow_clients(
        _address(stack), SLOW_CLIENTS, 8.0, lambda: health.append(_timed_get(f"{stack.http_address}/health"))
    )
    times = [t for t, _ in result if t is not None]
    print(
        f"MEASURE gateway slow headers: {len(times)}/{SLOW_CLIENTS} closed in {min(times, default=0):.2f}"
        f"-{max(times, default=0):.2f} s; /health meanwhile {health[0][0]} in {health[0][1] * 1000:.0f} ms"
    )
    assert len(times) == SLOW_CLIENTS  # every one closed (they used to be held as long as they liked)
    assert min(times) > HEADER_TIMEOUT - 0.1 and max(times) < HEADER_TIMEOUT + 2.0
    assert all(answer.startswith(b"HTTP/1.1 408 ") for _, answer in result)
    assert health[0][0] == 200 and health[0][1] < 2.0


def test_slow_headers_on_a_metrics_port_are_cut_off_while_it_answers() -> None:
    server, port = metrics_http.start_metrics_server("127.0.0.1", 0, {}, None, header_timeout=HEADER_TIMEOUT)
    scrapes: list[tuple[int, float]] = []
    try:
        result = _slow_clients(
            ("127.0.0.1", port),
            SLOW_CLIENTS,
            8.0,
            lambda: scrapes.append(_timed_get(f"http://127.0.0.1:{port}/metrics")),
        )
    finally:
        server.shutdown()
        server.server_close()
    times = [t for t, _ in result if t is not None]
    print(
        f"MEASURE metrics slow headers: {len(times)}/{SLOW_CLIENTS} closed in {min(times, default=0):.2f}"
        f"-{max(times, default=0):.2f} s; /metrics meanwhile {scrapes[0][0]} in {scrapes[0][1] * 1000:.0f} ms"
    )
    assert len(times) == SLOW_CLIENTS
    assert min(times) > HEADER_TIMEOUT - 0.1 and max(times) < HEADER_TIMEOUT + 2.0
    assert scrapes[0][0] == 200 and scrapes[0][1] < 2.0


def test_the_services_metrics_ports_bound_their_connections(stack: Stack) -> None:
    """Every service's metrics port is metrics_http's bounded server, with pages (the orchestrator's)
    or without (the weight store's, prometheus_client's unbounded start_http_server before)."""
    for name in ("orchestrator", "weight_store"):
        port = stack.metrics_ports[name]
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(metrics_http.MAX_CONNECTIONS)]
        try:
            time.sleep(0.3)  # all accepted, each holding a thread
            with socket.create_connection(("127.0.0.1", port), timeout=5) as one_more:
                one_more.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                assert one_more.recv(65536).startswith(b"HTTP/1.1 503 "), name  # at once, from the accepting thread
        finally:
            for s in idle:
                s.close()
        deadline = time.monotonic() + 5
        while True:  # the threads see their clients gone and free their slots
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    assert r.status == 200
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, f"{name}'s metrics port never freed its slots"
                time.sleep(0.1)


def test_the_gateway_bounds_its_connections(stack: Stack) -> None:
    """--max-connections bounds the requests in progress, not the sockets, and not GET /health or
    /metrics: connections that have sent nothing (a client trickling headers) must not shut everyone
    else out; open connections are bounded at OPEN_PER_SERVED times as many, beyond which a new one
    is closed at once."""
    served = 2
    argv = ["--max-connections", str(served), "--header-timeout", "4", "--body-timeout", "4"]
    labels = {"route": "other", "status": "503"}
    before = REGISTRY.get_sample_value("moe_lightning_gateway_requests_total", labels) or 0.0
    with _gateway_in_process(stack.api_address, *argv) as url:
        host, _, port = url.removeprefix("http://").rpartition(":")
        address = (host, int(port))
        idle = [socket.create_connection(address, timeout=10) for _ in range(4)]
        time.sleep(0.2)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # four silent sockets took no place
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        head += b"Content-Length: 100\r\n\r\n"
        slow = [socket.create_connection(address, timeout=10) for _ in range(served)]
        for s in slow:  # two requests in progress: their bodies are still to come
            s.sendall(head)
        time.sleep(0.3)
        busy = httpx.get(f"{url}/v1/models", timeout=5)
        assert busy.status_code == 503 and busy.headers["connection"] == "close"
        assert _openai_error(busy.json())["type"] == "service_unavailable"
        # the probes are not requests it serves: a liveness probe must not restart a gateway that is busy
        # (issue 54: /health answered 503 while --max-connections streams were open)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        assert httpx.get(f"{url}/metrics?x=1", timeout=5).status_code == 200
        assert httpx.post(f"{url}/health", timeout=5).status_code == 503  # only their GET
        time.sleep(0.3)  # their connections closed, as the count of open ones below assumes
        # open now: 4 idle + 2 in progress; up to OPEN_PER_SERVED x 2 are kept, the next is closed at once
        extra = [socket.create_connection(address, timeout=10) for _ in range(OPEN_PER_SERVED * served - 6)]
        refused = socket.create_connection(address, timeout=10)
        assert refused.recv(65536).startswith(b"HTTP/1.1 503 ")
        refused.close()
        for s in idle + extra:  # the header timeout frees them
            assert s.recv(65536).startswith(b"HTTP/1.1 408 ")
            s.close()
        for s in slow:  # and the body timeout those
            assert s.recv(65536).startswith(b"HTTP/1.1 408 ")
            s.close()
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    # the protocol's own answers are counted as the app's are (the gateway in this process counts in
    # its registry): the 503 to a request beyond the limit and the one to a connection beyond them
    after = REGISTRY.get_sample_value("moe_lightning_gateway_requests_total", labels) or 0.0
    assert after - before == 3


def test_an_oversized_head_is_a_431_not_buffered(stack: Stack) -> None:
    """llhttp has no limit on a header's size: 200 MB of one header were buffered whole."""
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: "
    with _PeakRss(stack.procs["gateway"].pid) as rss:
        flood = _Flood(_address(stack), head, b"a" * (1 << 20), 64 << 20).run()
    _measured("oversized head", flood, rss)
    (status, _, body), *_ = _answers(flood.received)
    assert status == 431 and _openai_error(body)["code"] == "headers_too_large"
    assert flood.sent < 32 << 20 and rss.growth_mib < 48


# -- item 11: GET /v1/models/{id}, the bearer scheme in any case -----------------------------------------


def test_a_model_by_its_id(stack: Stack, model_id: str) -> None:
    listed = httpx.get(f"{stack.http_address}/v1/models", headers=AUTH).json()["data"]
    one = httpx.get(f"{stack.http_address}/v1/models/{model_id}", headers=AUTH)
    assert one.status_code == 200 and [one.json()] == listed
    missing = httpx.get(f"{stack.http_address}/v1/models/gpt-4", headers=AUTH)
    error = _openai_error(missing.json())
    assert missing.status_code == 404 and error["type"] == "not_found_error" and error["code"] == "model_not_found"
    assert httpx.get(f"{stack.http_address}/v1/models/{model_id}").status_code == 401  # a /v1/ route: the token
    # counted by the route's template: a label per id (or per unknown path) would grow without end
    metrics = httpx.get(f"{stack.http_address}/metrics").text
    assert 'route="/v1/models/{model_id:path}",status="404"' in metrics and "gpt-4" not in metrics
    assert 'route="/v1/models/{model_id:path}",status="401"' in metrics


def test_the_bearer_scheme_is_case_insensitive_on_the_gateway(stack: Stack) -> None:
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = httpx.get(f"{stack.http_address}/v1/models", headers={"authorization": f"{scheme} {TOKEN}"})
        assert r.status_code == 200, scheme
    for wrong in (f"bearer {TOKEN.upper()}", f"Basic {TOKEN}", TOKEN, f"bearer{TOKEN}"):
        assert httpx.get(f"{stack.http_address}/v1/models", headers={"authorization": wrong}).status_code == 401


def test_the_bearer_scheme_is_case_insensitive_on_the_grpc_api(stack: Stack) -> None:
    with grpc.insecure_channel(stack.api_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for scheme in ("bearer", "BEARER"):
            info = stub.GetModelInfo(
                generation_pb2.GetModelInfoRequest(), metadata=(("authorization", f"{scheme} {TOKEN}"),), timeout=10
            )
            assert info.model.max_position_embeddings > 0
        with pytest.raises(grpc.RpcError) as wrong:
            stub.GetModelInfo(
                generation_pb2.GetModelInfoRequest(), metadata=(("authorization", "bearer x"),), timeout=10
            )
        assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_bearer_scheme_is_case_insensitive_on_threaded_grpc_services() -> None:
    """auth.BearerTokenInterceptor, the threaded runtime's (the orchestrator runs the asyncio one)."""

    def echo(request: bytes, _context: grpc.ServicerContext) -> bytes:
        return request

    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=(auth.BearerTokenInterceptor(TOKEN),))
    handlers = {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/test.Echo/Echo")
            assert call(b"hi", metadata=(("authorization", f"bearer {TOKEN}"),), timeout=10) == b"hi"
            with pytest.raises(grpc.RpcError) as wrong:
                call(b"hi", metadata=(("authorization", "bearer nope"),), timeout=10)
            assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(0)


def test_the_bearer_scheme_is_case_insensitive_on_the_metrics_pages() -> None:
    """The /debug pages beyond loopback (metrics_http.make_app, exposed) over a real HTTP server."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    def hello(query: Any) -> metrics_http.Page:
        return metrics_http.Page(200, "text/plain", b"hello")

    app = metrics_http.make_app({"/debug/hello": hello}, TOKEN, exposed=True)
    httpd = make_server("127.0.0.1", 0, app, handler_class=Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_port}/debug/hello"
        for scheme in ("bearer", "BEARER"):
            assert httpx.get(url, headers={"authorization": f"{scheme} {TOKEN}"}).text == "hello"
        assert httpx.get(url, headers={"authorization": "bearer wrong"}).status_code == 401
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_bearer_matches() -> None:
    assert auth.bearer_matches(f"bearer {TOKEN}", TOKEN) and auth.bearer_matches(f"BeArEr  {TOKEN} ".encode(), TOKEN)
    assert not auth.bearer_matches(f"bearer {TOKEN}x", TOKEN) and not auth.bearer_matches("", TOKEN)
    assert not auth.bearer_matches(TOKEN, TOKEN) and not auth.bearer_matches(f"Basic {TOKEN}", TOKEN)
