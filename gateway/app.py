"""The FastAPI application: OpenAI's routes over the gRPC Generation API (docs/openai.md).

Every choice of a request is one request on the orchestrator, so n choices and a list of prompts
batch with everything else there: a Generate call when not streamed, a stream on the gateway's one
GenerateStreams call when streamed (gateway/mux.py), whose pieces are exactly GenerateStream's
(held back near a stop string, so they add up to the final text). A client that goes away cancels
its requests: the orchestrator stops them at the next step and frees their KV.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import responses
from gateway.errors import ApiError, bad_request, from_grpc
from gateway.overhead import Clock
from gateway.schema import ChatCompletionRequest, CompletionRequest, UnsupportedField
from gateway.streaming import EventStream
from gateway.upstream import Upstream
from moe_lightning.api.generation.v1 import generation_pb2

REQUESTS = Counter("moe_lightning_gateway_requests_total", "HTTP requests by route and status", ["route", "status"])
T = TypeVar("T")


@dataclass
class Settings:
    model_name: str  # the id /v1/models lists and requests must name
    max_model_len: int
    auth_token: str | None = None
    max_body_bytes: int = 8 << 20


def create_app(settings: Settings, upstream: Upstream) -> FastAPI:
    app = FastAPI(title="moe-lightning", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Guard, settings=settings)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return bad_request(f"{param or 'body'}: {first.get('msg', 'invalid request')}", param).response()

    @app.get("/health")
    async def health() -> Response:
        ok = await upstream.serving()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        entry = {
            "id": settings.model_name,
            "object": "model",
            "created": responses.now(),
            "owned_by": "moe-lightning",
            "max_model_len": settings.max_model_len,
        }
        return {"object": "list", "data": [entry]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        inputs = _inputs(body, settings)
        logprobs = body.logprobs is not None
        rid = responses.new_id("cmpl")
        if body.stream:
            return _stream(upstream, settings, rid, inputs, body, chat=False, top=body.logprobs)
        clock = Clock()
        outputs = await _until_disconnected(request, clock.wait(upstream.generate_all(inputs)))
        clock.observe()
        return JSONResponse(responses.completion(rid, settings.model_name, outputs, body.n, logprobs))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        inputs = _inputs(body, settings)
        top = (body.top_logprobs or 0) if body.logprobs else None
        rid = responses.new_id("chatcmpl")
        if body.stream:
            return _stream(upstream, settings, rid, inputs, body, chat=True, top=top)
        clock = Clock()
        outputs = await _until_disconnected(request, clock.wait(upstream.generate_all(inputs)))
        clock.observe()
        return JSONResponse(responses.chat_completion(rid, settings.model_name, outputs, top))

    return app


class _Guard:
    """Body size and the bearer token, before any route runs; counts every answer. Plain ASGI, not
    Starlette's BaseHTTPMiddleware, which passes each streamed event through a memory stream of its
    own (a third of the gateway's CPU per event when it was one, docs/openai.md "Overhead")."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app, self.settings = app, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path: str = scope["path"]
        route = path if path.startswith("/v1/") else "other"
        status = 500

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if path.startswith("/v1/"):
                request = Request(scope)
                size = int(request.headers.get("content-length") or 0)
                if size > self.settings.max_body_bytes:
                    raise ApiError(
                        413,
                        f"the request body is {size} bytes, over {self.settings.max_body_bytes}",
                        "invalid_request_error",
                    )
                _check_token(request, self.settings.auth_token)
        except ApiError as exc:
            await exc.response()(scope, receive, counted)
        else:
            await self.app(scope, receive, counted)
        finally:
            REQUESTS.labels(route, str(status)).inc()


def _check_token(request: Request, token: str | None) -> None:
    if token is None:
        return
    got = request.headers.get("authorization", "")
    if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
        raise ApiError(
            401,
            "missing or wrong API key: send 'Authorization: Bearer <token>'",
            "authentication_error",
            code="invalid_api_key",
        )


def _inputs(
    body: CompletionRequest | ChatCompletionRequest, settings: Settings
) -> list[generation_pb2.GenerationInput]:
    if body.model != settings.model_name:
        raise ApiError(
            404,
            f"model {body.model!r} does not exist here: this server serves {settings.model_name!r}",
            "not_found_error",
            "model",
            "model_not_found",
        )
    try:
        return body.inputs()
    except UnsupportedField as exc:
        raise bad_request(str(exc), exc.param) from None


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
    return EventStream(
        upstream, inputs, rid=rid, model=settings.model_name, chat=chat, top=top, n=n, include_usage=include_usage
    )
