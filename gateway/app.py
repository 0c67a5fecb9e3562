"""The FastAPI application: OpenAI's routes over the gRPC Generation API (docs/openai.md).

Every choice of a request is one Generate (or GenerateStream) call on the orchestrator, so n
choices and a list of prompts batch with everything else there. A streamed response sends, per
choice, exactly the text pieces our gRPC stream sends (held back near a stop string, so the pieces
add up to the final text). A client that goes away cancels its calls: the orchestrator stops the
requests at the next step and frees their KV.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import responses
from gateway.errors import ApiError, bad_request, from_grpc
from gateway.schema import ChatCompletionRequest, CompletionRequest, UnsupportedField
from gateway.upstream import Upstream
from moe_lightning.api.generation.v1 import generation_pb2

REQUESTS = Counter("moe_lightning_gateway_requests_total", "HTTP requests by route and status", ["route", "status"])
OVERHEAD = Histogram(
    "moe_lightning_gateway_overhead_seconds",
    "The gateway's own time per request: the whole request less the time spent waiting on the gRPC API",
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
)
T = TypeVar("T")


@dataclass
class Settings:
    model_name: str  # the id /v1/models lists and requests must name
    max_model_len: int
    auth_token: str | None = None
    max_body_bytes: int = 8 << 20


class _Clock:
    """Time spent waiting on the gRPC API, so that the gateway's own share can be told apart."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.upstream = 0.0

    async def wait(self, aw: Awaitable[T]) -> T:
        t0 = time.perf_counter()
        try:
            return await aw
        finally:
            self.upstream += time.perf_counter() - t0

    def observe(self) -> None:
        OVERHEAD.observe(max(0.0, time.perf_counter() - self.start - self.upstream))


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
            return _stream(request, upstream, settings, rid, inputs, body, chat=False, top=body.logprobs)
        clock = _Clock()
        outputs = await _until_disconnected(request, clock.wait(upstream.generate_all(inputs)))
        clock.observe()
        return JSONResponse(responses.completion(rid, settings.model_name, outputs, body.n, logprobs))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        inputs = _inputs(body, settings)
        top = (body.top_logprobs or 0) if body.logprobs else None
        rid = responses.new_id("chatcmpl")
        if body.stream:
            return _stream(request, upstream, settings, rid, inputs, body, chat=True, top=top)
        clock = _Clock()
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


Item = tuple[int, generation_pb2.GenerateStreamResponse | BaseException]


async def _merged(
    upstream: Upstream, inputs: list[generation_pb2.GenerationInput], clock: _Clock
) -> AsyncIterator[Item]:
    """Every choice's stream as (choice, message), as they come; an error as (choice, exception).
    One choice (the common case) is read directly; several through a queue. Leaving early (the
    client went away) cancels every call."""
    if len(inputs) == 1:
        stream = upstream.stream(inputs[0]).__aiter__()
        try:
            while True:
                try:
                    msg = await clock.wait(stream.__anext__())
                except StopAsyncIteration:
                    return
                except Exception as exc:
                    yield 0, exc
                    return
                yield 0, msg
        finally:
            await stream.aclose()
    queue: asyncio.Queue[tuple[int, generation_pb2.GenerateStreamResponse | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, m: generation_pb2.GenerationInput) -> None:
        try:
            async for msg in upstream.stream(m):
                await queue.put((index, msg))
            await queue.put((index, None))
        except Exception as exc:
            await queue.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, m)) for i, m in enumerate(inputs)]
    try:
        open_choices = len(inputs)
        while open_choices:
            index, item = await clock.wait(queue.get())
            if item is None:
                open_choices -= 1
                continue
            yield index, item
    finally:
        for t in tasks:
            t.cancel()


def _sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def _stream(
    request: Request,
    upstream: Upstream,
    settings: Settings,
    rid: str,
    inputs: list[generation_pb2.GenerationInput],
    body: CompletionRequest | ChatCompletionRequest,
    chat: bool,
    top: int | None,
) -> StreamingResponse:
    """Server-sent events: per choice, one chunk per piece of our gRPC stream, a last chunk with the
    finish reason, a usage chunk when asked (stream_options.include_usage), then `data: [DONE]`."""
    created = responses.now()
    model = settings.model_name
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def piece(index: int, text: str, lps: list, offset: int) -> dict[str, Any]:
        if chat:
            out: dict[str, Any] = {"index": index, "delta": {"content": text}, "finish_reason": None}
            out["logprobs"] = responses.chat_logprobs(lps, top) if top is not None else None
        else:
            out = {"index": index, "text": text, "finish_reason": None}
            out["logprobs"] = responses.completion_logprobs(lps, offset) if top is not None else None
        return out

    # a text-only piece is the hot path (a chunk per piece per stream): its JSON is framed once
    head = json.dumps(responses.chunk(rid, model, chat, [], created), separators=(",", ":"))[: -len("[]}")] + "["
    frame = (
        '{"index":%d,"delta":{"content":%s},"finish_reason":null,"logprobs":null}]}'
        if chat
        else ('{"index":%d,"text":%s,"finish_reason":null,"logprobs":null}]}')
    )

    async def events() -> AsyncIterator[bytes]:
        clock = _Clock()
        finals: dict[int, generation_pb2.GenerationOutput] = {}
        offsets = [0] * len(inputs)
        if chat:
            first = [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                for i in range(len(inputs))
            ]
            yield _sse(responses.chunk(rid, model, chat, first, created))
        async for index, item in _merged(upstream, inputs, clock):
            if isinstance(item, BaseException):
                error = (
                    from_grpc(item)
                    if isinstance(item, grpc.aio.AioRpcError)
                    else ApiError(500, str(item), "internal_error")
                )
                yield _sse(error.body())
                break
            if item.logprobs:
                piece_obj = piece(index, item.text, list(item.logprobs), offsets[index])
                yield _sse(responses.chunk(rid, model, chat, [piece_obj], created))
            elif item.text:
                yield f"data: {head}{frame % (index, json.dumps(item.text))}\n\n".encode()
            offsets[index] += len(item.text)
            if item.HasField("output"):
                finals[index] = item.output
                last = {"index": index, "finish_reason": responses.FINISH.get(item.output.finish_reason)}
                last |= {"delta": {}} if chat else {"text": ""}
                last["logprobs"] = None
                yield _sse(responses.chunk(rid, model, chat, [last], created))
        else:
            if include_usage:
                ordered = [finals[i] for i in sorted(finals)]
                usage = responses.usage(ordered, len(ordered) if chat else body.n)
                yield _sse({**responses.chunk(rid, model, chat, [], created), "usage": usage})
        yield b"data: [DONE]\n\n"
        clock.observe()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
