"""`serve` on grpc.aio: for a service whose calls mostly wait (the orchestrator's public API), so that a
waiting call holds no thread. Many long generations then cannot starve health checks or new calls of
a thread (issue 14, item 5): what bounds waiting work is the scheduler's queue (--max-queue).

The life is runtime.py's: live (health "" SERVING, the service NOT_SERVING) before `build` runs in a
worker thread, ready after; SIGTERM flips health to NOT_SERVING, runs the drain hooks (in a thread:
they may wait for in-flight work, which the event loop keeps serving), stops the server within the
grace period, then runs the clean-up hooks. The interceptors are the aio twins of errors.py's error
mapping and auth.py's bearer token, and (from concurrency.py) AioConcurrencyLimit: a server's own bound on the calls in
progress, past which a call is refused RESOURCE_EXHAUSTED, named and counted (grpc core's silent
backlog cancellation, which used to be that bound, is raised out of its way: pending_call_options).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_lightning.config.service import ServiceConfig

import asyncio
import contextlib
import inspect
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from moe_lightning.service.auth import EXEMPT_PREFIXES, bearer_matches
from moe_lightning.service.concurrency import AioConcurrencyLimit, pending_call_options
from moe_lightning.service.errors import _lenient, _Undecodable, rejection
from moe_lightning.service.metrics import SERVING as SERVING_GAUGE
from moe_lightning.service.metrics import count_rpc
from moe_lightning.service.metrics_http import Route
from moe_lightning.service.runtime import (
    MAX_MESSAGE_BYTES,
    ServiceHooks,
    _safe,
    bind,
    prepare_process,
    server_options,
)

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
UNAUTHENTICATED = "missing or wrong bearer token: send metadata 'authorization: Bearer <token>'"


class AioErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """errors.py's ErrorMappingInterceptor for coroutine handlers: a domain exception becomes its
    documented status, an undecodable request INVALID_ARGUMENT."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        handler = handler._replace(request_deserializer=_lenient(handler.request_deserializer))
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await _reject_undecodable(request, context)
                try:
                    response = await inner(request, context)
                except Exception as exc:
                    await _abort(context, exc, method)
                except asyncio.CancelledError:  # the client left or its deadline passed: counted too
                    count_rpc(method, _cancel_code(context))
                    raise
                count_rpc(method, "OK")
                return response

            return handler._replace(unary_unary=unary)
        # grpc runs a streaming handler by its kind: an async generator's messages are sent for it, a
        # coroutine writes its own (context.write: grpc's health Watch). The wrapper must be of the
        # same kind, or the call fails with INTERNAL ('async for' over a coroutine).
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream
            if inspect.iscoroutinefunction(inner_stream):

                async def stream_writer(request: Any, context: grpc.aio.ServicerContext) -> None:
                    await _reject_undecodable(request, context)
                    await _mapped_writer(inner_stream(request, context), context, method)

                return handler._replace(unary_stream=stream_writer)

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                await _reject_undecodable(request, context)
                async for msg in _mapped(inner_stream(request, context), context, method):
                    yield msg

            return handler._replace(unary_stream=stream)
        if handler.stream_stream is not None:  # a malformed message in the stream is the handler's to refuse
            inner_bidi = handler.stream_stream
            if inspect.iscoroutinefunction(inner_bidi):

                async def bidi_writer(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
                    await _mapped_writer(inner_bidi(requests, context), context, method)

                return handler._replace(stream_stream=bidi_writer)

            async def bidi(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async for msg in _mapped(inner_bidi(requests, context), context, method):
                    yield msg

            return handler._replace(stream_stream=bidi)
        return handler


def _cancel_code(context: grpc.aio.ServicerContext) -> str:
    """How a cancelled handler's call ended: its deadline passed, or its client cancelled it."""
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"


@contextlib.asynccontextmanager
async def _call_status(context: grpc.aio.ServicerContext, method: str) -> AsyncIterator[None]:
    """A streaming handler's exception as the call's status; the call's outcome counted."""
    try:
        yield
    except Exception as exc:
        await _abort(context, exc, method)
    except asyncio.CancelledError:
        count_rpc(method, _cancel_code(context))
        raise
    count_rpc(method, "OK")


async def _mapped(responses: AsyncIterator[Any], context: grpc.aio.ServicerContext, method: str) -> AsyncIterator[Any]:
    """A streaming handler's responses, its exception as the call's status."""
    async with _call_status(context, method):
        async for msg in responses:
            yield msg


async def _mapped_writer(call: Awaitable[None], context: grpc.aio.ServicerContext, method: str) -> None:
    """_mapped for a streaming handler that writes its own messages."""
    async with _call_status(context, method):
        await call


async def _reject_undecodable(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request could not be parsed ({request.error}); string fields such as text and stop "
            "must be valid UTF-8",
        )


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    if isinstance(exc, grpc.aio.AbortError):
        raise exc  # context.abort() already set the status
    await context.abort(*rejection(exc, method))


class AioBearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """auth.py's BearerTokenInterceptor for the aio server: every call but health and reflection needs
    `authorization: Bearer <token>`; unary and streaming handlers alike are denied without it."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the auth token must not be empty")
        self._token = token

    def _ok(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                return bearer_matches(value, self._token)  # `bearer` and `BEARER` too (RFC 7235)
        return False

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIXES) or self._ok(details.invocation_metadata):
            return handler

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)
            yield None  # never reached: makes this the async generator a streaming handler is

        if handler.unary_stream is not None:
            return handler._replace(unary_stream=deny_stream)
        if handler.stream_stream is not None:
            return handler._replace(stream_stream=deny_stream)
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=deny)
        return None  # no client-streaming-only methods here: refuse as unimplemented rather than serve unchecked


class AioServiceRuntime(ServiceHooks):
    """What `build` sees of the runtime (as runtime.ServiceRuntime): log, port, stopping, set_serving
    from any thread, on_drain / on_shutdown hooks. Created on the event loop's thread."""

    def __init__(
        self,
        name: str,
        address: str,
        metrics_port: int | None,
        metrics_host: str,
        grace_seconds: float,
        server_credentials: grpc.ServerCredentials | None,
        interceptors: tuple[grpc.aio.ServerInterceptor, ...],
        max_receive_bytes: int,
        pages: Mapping[str, Route] | None = None,
        pages_token: str | None = None,
        max_concurrent_rpcs: int | None = None,
    ) -> None:
        super().__init__()
        self.name = name
        self.grace_seconds = grace_seconds
        self.log = structlog.get_logger()
        self.loop = asyncio.get_running_loop()
        self.server = grpc.aio.server(
            interceptors=(*interceptors, AioErrorMappingInterceptor()),
            options=[*server_options(max_receive_bytes), *pending_call_options(max_concurrent_rpcs)],
        )
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.address = address
        self.port, self.metrics_port = bind(
            self.server, address, server_credentials, metrics_port, metrics_host, pages, pages_token
        )
        self._stopping = threading.Event()
        self._stopped = asyncio.Event()
        self._stop_task: asyncio.Future[None] | None = None

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def _set_health(self, ready: bool) -> None:
        await self.health.set(self.name, SERVING if ready else NOT_SERVING)
        SERVING_GAUGE.set(1 if ready and not self.stopping else 0)
        await self.health.set("", NOT_SERVING if self.stopping else SERVING)

    def set_serving(self, ready: bool) -> None:
        """Callable from any thread (the supervisor's included)."""
        try:
            asyncio.run_coroutine_threadsafe(self._set_health(ready), self.loop)
        except RuntimeError:  # the loop closed: the process is ending
            pass

    async def start(self) -> None:
        await self._set_health(False)
        reflection.enable_server_reflection(self._service_names, self.server)
        await self.server.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self._on_signal)
        self.log.info("service_started", address=self.address, port=self.port, metrics_port=self.metrics_port)

    def _on_signal(self) -> None:
        self._stop_task = asyncio.ensure_future(self.stop())  # held: the loop keeps only weak references

    async def stop(self) -> None:
        if self._stopping.is_set():
            await self._stopped.wait()  # a second caller (a failed start) returns once the first is done
            return
        self._stopping.set()
        self.log.info("service_stopping", grace_seconds=self.grace_seconds)
        await self.health.enter_graceful_shutdown()
        SERVING_GAUGE.set(0)
        for fn in self._before_drain:  # in a thread: a drain waits for calls this loop is serving
            await self.loop.run_in_executor(None, _safe, fn, self.log)
        await self.server.stop(self.grace_seconds)
        for fn in reversed(self._cleanups):
            await self.loop.run_in_executor(None, _safe, fn, self.log)
        self.log.info("service_stopped")
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()


def serve_aio(
    config: ServiceConfig,
    owner: str,
    service: str,
    add_fn: Callable[[Any, Any], None],
    servicer: Any,
    build: Callable[[AioServiceRuntime], Mapping[str, Any]],
    *,
    failures: tuple[type[Exception], ...] = (Exception,),
    grace_seconds: float = 10.0,
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
    pages: Mapping[str, Route] | None = None,
    concurrency: AioConcurrencyLimit | None = None,
) -> int:
    """runtime.serve's contract on an asyncio server; `build` runs in a worker thread. `pages`: served on
    the metrics port beside /metrics (beyond loopback only with the API's token, metrics_http.py);
    `concurrency`: the calls it takes at once (after the token check: a caller without one is refused
    as UNAUTHENTICATED however busy the server is)."""
    log, credentials, _ = prepare_process(config, owner, service)  # the public API checks no internal secret
    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = (
        (AioBearerTokenInterceptor(config.auth_token),) if getattr(config, "auth_token", None) else ()
    )
    if concurrency is not None:
        interceptors = (*interceptors, concurrency)

    async def life() -> int:
        runtime = AioServiceRuntime(
            service,
            config.address,
            config.metrics_port,
            config.metrics_host,
            grace_seconds,
            credentials,
            interceptors,
            max_receive_bytes,
            pages,
            getattr(config, "auth_token", None),
            concurrency.limit if concurrency is not None else None,
        )
        runtime.add_service(add_fn, servicer, service)
        await runtime.start()
        try:
            serving = await runtime.loop.run_in_executor(None, build, runtime)
        except failures as exc:
            log.error("startup_failed", error=str(exc))
            await runtime.stop()
            return 1
        runtime.set_serving(True)
        log.info("serving", **serving)
        await runtime.wait()
        return 0

    return asyncio.run(life())
