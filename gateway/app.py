"""The FastAPI application: OpenAI's routes over the gRPC Generation API (docs/openai.md).

Every choice of a request is one request on the orchestrator, so n choices and a list of prompts
batch with everything else there: one Generate call, or one BatchGenerate for several choices, when not
streamed (so a client that leaves cancels all of them at once), a stream on the gateway's one
GenerateStreams call when streamed (gateway/mux.py), whose pieces are exactly GenerateStream's
(held back near a stop string, so they add up to the final text). A client that goes away cancels
its requests: the orchestrator stops them at the next step and frees their KV.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import responses
from gateway.body import parse_body
from gateway.errors import ApiError, bad_request, from_grpc, from_http, internal_error
from gateway.overhead import Clock
from gateway.schema import ChatCompletionRequest, CompletionRequest, UnsupportedField
from gateway.streaming import EventStream
from gateway.upstream import Upstream
from moe_lightning.api.generation.v1 import generation_pb2
from moe_lightning.service.auth import bearer_matches

REQUESTS = Counter("moe_lightning_gateway_requests_total", "HTTP requests by route and status", ["route", "status"])
T = TypeVar("T")
FIELD_ERRORS = ("unknown_field", "unsupported_field")  # gateway/schema.py's refusals of a field


@dataclass
class Settings:
    model_name: str  # the id /v1/models lists and requests must name
    max_model_len: int
    auth_token: str | None = None
    max_body_bytes: int = 8 << 20
    body_timeout: float = 60.0  # seconds for the whole body, once the headers are in


def create_app(settings: Settings, upstream: Upstream) -> FastAPI:
    app = FastAPI(title="moe-lightning", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Guard, settings=settings, routes=app.router.routes)  # the list the routes below join
    created = responses.now()  # one model object, the same in the list and on its own

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # its loc is ("body", offset): no field to name
            reason = (first.get("ctx") or {}).get("error", "invalid JSON")
            return bad_request(f"the body is not valid JSON: {reason} (at character {first['loc'][-1]})").response()
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        fields = [e["msg"] for e in exc.errors() if e.get("type") in FIELD_ERRORS]
        if len(fields) > 1:  # every field it does not take, named at once: one round trip to fix them all
            return bad_request("; ".join(fields), param).response()
        return bad_request(f"{param or 'body'}: {first.get('msg', 'invalid request')}", param).response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _from_http_exception(request, exc).response()

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception) -> JSONResponse:
        # only what escapes _Guard itself comes here (the guard answers the app's own faults)
        structlog.get_logger().error("request_failed", path=request.url.path, exc_info=exc)
        return internal_error().response()

    @app.get("/health")
    async def health() -> Response:
        ok = await upstream.serving()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    def model() -> dict[str, Any]:
        return {
            "id": settings.model_name,
            "object": "model",
            "created": created,
            "owned_by": "moe-lightning",
            "max_model_len": settings.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model()]}

    @app.get("/v1/models/{model_id:path}")  # :path: a served name may hold a slash (org/name)
    async def one_model(model_id: str) -> dict[str, Any]:
        if model_id != settings.model_name:
            raise _unknown_model(model_id, settings)
        return model()

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        inputs = _inputs(body, settings, upstream.max_batch_prompts)
        rid = responses.new_id("cmpl")
        if body.stream:
            return _stream(upstream, settings, rid, inputs, body, chat=False, top=body.logprobs)
        clock = Clock()
        outputs = await _until_disconnected(request, clock.wait(upstream.generate_all(inputs, body.n)))
        clock.observe()
        return await _json(lambda: body.response(rid, settings.model_name, outputs), outputs)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        inputs = _inputs(
            body, settings, upstream.max_batch_prompts, upstream.tool_call_format, upstream.reasoning_format
        )
        top = (body.top_logprobs or 0) if body.logprobs else None
        rid = responses.new_id("chatcmpl")
        if body.stream:
            return _stream(upstream, settings, rid, inputs, body, chat=True, top=top)
        clock = Clock()
        # a chat is one prompt: its n choices are all its inputs
        outputs = await _until_disconnected(request, clock.wait(upstream.generate_all(inputs, len(inputs))))
        clock.observe()
        formats = (upstream.tool_call_format, upstream.reasoning_format)
        return await _json(lambda: body.response(rid, settings.model_name, outputs, *formats), outputs)

    return app


class _Guard:
    """Before any route runs: the body's size and the bearer token; the body read whole, counted as it
    arrives (413 past `max_body_bytes`, chunked or not: a Content-Length alone was trusted, and a
    chunked body was read whole whatever its size) and within `body_timeout` (408); an OpenAI-shaped
    500 for whatever else the app raises; and every answer counted. Plain ASGI, not Starlette's
    BaseHTTPMiddleware, which passes each streamed event through a memory stream of its own (a third
    of the gateway's CPU per event when it was one, docs/openai.md "Overhead")."""

    def __init__(self, app: ASGIApp, settings: Settings, routes: Sequence[BaseRoute]) -> None:
        self.app, self.settings, self.routes = app, settings, routes
        self.log = structlog.get_logger()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500
        body_read = started = False

        async def counted(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                if not body_read:
                    # answered before the whole body came (413, 408, 401): without this uvicorn would
                    # keep the connection and read the rest of the body only to drop it
                    message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        try:
            headers = Headers(scope=scope)
            _check_declared_size(headers, self.settings.max_body_bytes)
            if scope["path"].startswith("/v1/"):
                _check_token(headers, self.settings.auth_token)
            first = await _read_body(receive, self.settings.max_body_bytes, self.settings.body_timeout)
            if first["type"] == "http.disconnect":
                status = 499  # gone before its body was in: nothing to run, nobody to answer
                return
            body_read = True
            await self.app(scope, _replay(first, receive), counted)
        except ApiError as exc:
            if started:
                raise
            await exc.response()(scope, receive, counted)
        except Exception:
            if started:  # an answer half sent cannot become a 500: uvicorn closes the connection
                raise
            # a fault of ours: logged whole, answered without a traceback or a path of this server
            self.log.exception("request_failed", path=scope["path"], method=scope.get("method"))
            await internal_error().response()(scope, receive, counted)
        finally:
            REQUESTS.labels(self._route(scope), str(status)).inc()

    def _route(self, scope: Scope) -> str:
        """The route's template, not the path: a label per path would grow without end (any
        /v1/models/<id>, any unknown path)."""
        route = scope.get("route")  # set by the router once it matched
        if route is None:  # answered here before the router ran: match as it would
            route = next((r for r in self.routes if r.matches(scope)[0] == Match.FULL), None)
        path = getattr(route, "path", "")
        return path if path.startswith("/v1/") else "other"


def _check_declared_size(headers: Headers, limit: int) -> None:
    """A Content-Length over the limit is refused before a byte of the body is read."""
    declared = headers.get("content-length")
    if declared is None:
        return
    try:
        size = int(declared)
    except ValueError:
        raise bad_request(f"Content-Length is not a number: {declared[:40]!r}") from None
    if size > limit:
        raise from_http(413, f"the request body is {size} bytes, over {limit}", "request_too_large")


async def _read_body(receive: Receive, limit: int, timeout: float) -> Message:
    """The whole body as one http.request message, or the http.disconnect that came first. Counted as
    it arrives, whatever the framing (chunked, or more bytes than a Content-Length that lied, which
    the HTTP parser then cuts at that length): past `limit` it is a 413 with the rest never read."""
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return message
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise from_http(413, f"the request body is over {limit} bytes", "request_too_large")
                if chunk:
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
    except TimeoutError:
        raise from_http(408, f"the request body did not arrive within {timeout:g} s", "request_timeout") from None


def _replay(first: Message, receive: Receive) -> Receive:
    """`receive` with the body already read handed out first; then the server's own (a disconnect)."""
    pending = [first]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


def _check_token(headers: Headers, token: str | None) -> None:
    if token is None:
        return
    if not bearer_matches(headers.get("authorization", ""), token):  # `bearer` and `BEARER` too (RFC 7235)
        raise ApiError(
            401,
            "missing or wrong API key: send 'Authorization: Bearer <token>'",
            "authentication_error",
            code="invalid_api_key",
        )


def _from_http_exception(request: Request, exc: HTTPException) -> ApiError:
    """Starlette's and FastAPI's own refusals (an unknown route, a wrong method, a body FastAPI could
    not parse) in OpenAI's shape, naming what was wrong where FastAPI's `detail` does not."""
    cause = exc.__cause__  # FastAPI raises its "error parsing the body" 400 from the parser's error
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        return from_http(404, f"there is no route {where}", "unknown_url")
    if exc.status_code == 405:
        return from_http(405, f"{where} is not allowed", "method_not_allowed", dict(exc.headers or {}))
    if exc.status_code == 400 and isinstance(cause, UnicodeDecodeError):
        return bad_request(f"the body is not valid UTF-8: {cause.reason} at byte {cause.start}")
    if exc.status_code == 400 and isinstance(cause, RecursionError):
        return bad_request("the body's JSON is nested too deeply")
    return from_http(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))


def _unknown_model(name: str, settings: Settings) -> ApiError:
    return ApiError(
        404,
        f"model {name!r} does not exist here: this server serves {settings.model_name!r}",
        "not_found_error",
        "model",
        "model_not_found",
    )


def _inputs(
    body: CompletionRequest | ChatCompletionRequest,
    settings: Settings,
    max_inputs: int,
    tool_format: str = "",
    reasoning_format: str = "",
) -> list[generation_pb2.GenerationInput]:
    """The request's inputs, refused before they are built when no server could take them: prompts
    x n over `max_inputs` (the server's max_batch_prompts), a prompt longer than the model's context."""
    if body.model != settings.model_name:
        raise _unknown_model(body.model, settings)
    try:
        if isinstance(body, ChatCompletionRequest):
            return body.inputs(settings.max_model_len, max_inputs, tool_format, reasoning_format)
        return body.inputs(settings.max_model_len, max_inputs)
    except UnsupportedField as exc:
        raise bad_request(str(exc), exc.param) from None


# A response with more log-probability positions or text than this is built and serialised on a
# worker thread: up to MAX_RESPONSE_LOGPROBS entries (moe_lightning/validation.py) are ~150 MB of
# Python objects and 32 MiB of JSON, seconds of the event loop that /health and every stream share
OFF_LOOP_POSITIONS = 2048
OFF_LOOP_TEXT_CHARS = 1 << 20


async def _json(render: Callable[[], dict[str, Any]], outputs: Sequence[generation_pb2.GenerationOutput]) -> Response:
    """JSONResponse(render()): on the event loop when small, else on a thread (where the loop gets
    the GIL back between its Python steps)."""
    positions = sum(len(o.logprobs) + len(o.prompt_logprobs) for o in outputs)
    text = sum(len(o.text) + len(o.prompt_text) for o in outputs)
    if positions <= OFF_LOOP_POSITIONS and text <= OFF_LOOP_TEXT_CHARS:
        return JSONResponse(render())
    return await asyncio.to_thread(lambda: JSONResponse(render()))


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`, cancelled (its gRPC calls with it) if the client goes away first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            raise ApiError(499, "the client closed the connection", "cancelled")
        try:
            return task.result()
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc) from None
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _stream(
    upstream: Upstream,
    settings: Settings,
    rid: str,
    inputs: list[generation_pb2.GenerationInput],
    body: CompletionRequest | ChatCompletionRequest,
    chat: bool,
    top: int | None,
) -> EventStream:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    n = len(inputs) if chat else body.n  # a chat request is one prompt
    shapes = None
    if isinstance(body, ChatCompletionRequest):
        shapes = body.shapes(upstream.tool_call_format, upstream.reasoning_format)
    return EventStream(
        upstream,
        inputs,
        rid=rid,
        model=settings.model_name,
        chat=chat,
        top=top,
        n=n,
        include_usage=include_usage,
        shapes=shapes,
    )
