"""A server's own bound on the gRPC calls in progress (--max-concurrent-rpcs on the orchestrator), and
the core backlog set beside it so that the bound, not gRPC core, is what a burst meets
(docs/reliability.md, "What one request may cost")."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from moe_lightning.service.auth import EXEMPT_PREFIXES
from moe_lightning.service.metrics import count_rpc

# grpc core's own backlog protection (grpc.server.max_pending_requests, default 1000, and
# max_pending_requests_hard_limit, default 3000): a call that arrived but that the application has not
# yet asked for (the aio server asks for one at a time, from its event loop, so a burst waits there) is
# dropped at random once 1000 wait, every one past 3000, as CANCELLED, a status no client can tell
# from its own cancel, unseen by any interceptor and so uncounted. 3,000 Generate calls at once lost
# 650-750 of them so, far below --max-queue. A server that states a concurrency limit raises the
# backlog to PENDING_PER_LIMIT times it, so that a burst up to that size meets the limit's named and
# counted RESOURCE_EXHAUSTED; no further, since each waiting call holds its stream's buffers in core.
PENDING_PER_LIMIT = 2


def pending_call_options(max_concurrent_rpcs: int | None) -> list[tuple[str, int]]:
    """The core's backlog bounds for a server that refuses calls past `max_concurrent_rpcs` itself
    (none: core's own)."""
    if max_concurrent_rpcs is None:
        return []
    bound = max(3000, PENDING_PER_LIMIT * max_concurrent_rpcs)
    return [("grpc.server.max_pending_requests", bound), ("grpc.server.max_pending_requests_hard_limit", bound)]


class AioConcurrencyLimit(grpc.aio.ServerInterceptor):
    """At most `limit` calls in their handlers at once (health and reflection aside); one more is
    answered RESOURCE_EXHAUSTED at once, with a message naming the limit and `flag`, and counted
    (moe_lightning_rpc_handled_total and `refused`), rather than waiting for work that cannot start.
    The handlers all run on the server's one event loop, so a plain count is exact."""

    def __init__(
        self, limit: int, flag: str, refused: Callable[[], None] | None = None, gauge: Any | None = None
    ) -> None:
        if limit < 1:
            raise ValueError(f"{flag} must be 1 or more, got {limit}")
        self.limit, self.flag = limit, flag
        self.active = 0
        self._refused = refused
        self._gauge = gauge  # a prometheus Gauge of the calls in their handlers, if given

    def _enter(self) -> bool:
        if self.active >= self.limit:
            return False
        self.active += 1
        if self._gauge is not None:
            self._gauge.set(self.active)
        return True

    def _leave(self) -> None:
        self.active -= 1
        if self._gauge is not None:
            self._gauge.set(self.active)

    async def _refuse(self, context: grpc.aio.ServicerContext, method: str) -> None:
        count_rpc(method, grpc.StatusCode.RESOURCE_EXHAUSTED.name)
        if self._refused is not None:
            self._refused()
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{self.active} calls are in progress, the most this server takes at once ({self.flag} "
            f"{self.limit}); retry later, or send a list of prompts as one BatchGenerate",
        )

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIXES):
            return handler  # health must answer most of all when the server is busiest
        method = details.method
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if not self._enter():
                    await self._refuse(context, method)
                try:
                    return await inner(request, context)
                finally:
                    self._leave()

            return handler._replace(unary_unary=unary)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if not self._enter():
                    await self._refuse(context, method)
                try:
                    async for msg in inner_stream(request, context):
                        yield msg
                finally:
                    self._leave()

            return handler._replace(unary_stream=stream)
        if handler.stream_stream is not None:
            inner_bidi = handler.stream_stream

            async def bidi(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if not self._enter():
                    await self._refuse(context, method)
                try:
                    async for msg in inner_bidi(requests, context):
                        yield msg
                finally:
                    self._leave()

            return handler._replace(stream_stream=bidi)
        return handler
