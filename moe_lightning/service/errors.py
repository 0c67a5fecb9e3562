"""Domain exceptions -> gRPC status codes, in one interceptor; INTERNAL only for bugs."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import structlog


class ServiceError(Exception):
    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class NotReadyError(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class OutOfMemoryError(ResourceExhaustedError):
    """A step needed more device (or host) memory than was free; the service keeps serving."""


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA raises torch.OutOfMemoryError; the CPU allocator a RuntimeError of its own wording;
    Python objects a MemoryError."""
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")  # not imported: nothing here raised its error (clients go without)
    if torch is not None and isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


class UnavailableError(ServiceError):
    """A dependency is down; the client may retry."""

    code = grpc.StatusCode.UNAVAILABLE


class ShuttingDownError(UnavailableError):
    pass


def count_rpc(method: str, code: str) -> None:
    # imported when a server counts, not when a client imports the error types: the gateway (which
    # imports them through moe_lightning.validation) must not export a service's gauges, and a
    # `moe_lightning_serving 0` there would page as a service that is down
    from moe_lightning.service.metrics import count_rpc as count

    count(method, code)


# Domain errors by module and class name, not imported here: their modules import torch, which the
# orchestrator, the command line and the client run without. An error's class is loaded wherever one
# was raised, so a class whose module is not loaded cannot match (see _codes).
DOMAIN_CODES: list[tuple[str, str, grpc.StatusCode]] = [
    ("moe_lightning.request", "InvalidRequestError", grpc.StatusCode.INVALID_ARGUMENT),
    ("moe_lightning.spec", "ModelSpecError", grpc.StatusCode.FAILED_PRECONDITION),
    ("moe_lightning.safetensors_header", "CheckpointError", grpc.StatusCode.FAILED_PRECONDITION),
    ("moe_lightning.kv_cache", "KVCacheFullError", grpc.StatusCode.RESOURCE_EXHAUSTED),
    ("moe_lightning.shm.channel", "PeerDiedError", grpc.StatusCode.UNAVAILABLE),
    ("moe_lightning.shm.channel", "ChannelClosedError", grpc.StatusCode.UNAVAILABLE),
    ("moe_lightning.shm.channel", "ChannelTimeoutError", grpc.StatusCode.UNAVAILABLE),
]


def _codes() -> Iterator[tuple[type[BaseException], grpc.StatusCode]]:
    for module, name, code in DOMAIN_CODES:
        loaded = sys.modules.get(module)
        if loaded is not None:
            yield getattr(loaded, name), code


def status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, ServiceError):
        return exc.code
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        code = exc.code()
        # a dependency's failure is ours to report as UNAVAILABLE unless it was the caller's fault
        return (
            code
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
            else (grpc.StatusCode.UNAVAILABLE)
        )
    for kind, code in _codes():
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def rejection(exc: BaseException, method: str, count: bool = True) -> tuple[grpc.StatusCode, str]:
    """The status and message a failed call is answered with, logged once (a bug with its traceback);
    counted as the call's outcome unless `count` is off (one stream of a GenerateStreams call)."""
    code = status_for(exc)
    if count:
        count_rpc(method, code.name)
    message = exc.details() if isinstance(exc, grpc.RpcError) and hasattr(exc, "details") else str(exc)
    log = structlog.get_logger()
    if code == grpc.StatusCode.INTERNAL:
        log.error("rpc_failed", method=method, exc_info=exc)
    else:
        log.info("rpc_rejected", method=method, code=code.name, error=message)
    return code, message or code.name


def _abort(context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    context.abort(*rejection(exc, method))


class _Undecodable:
    """A request whose bytes did not parse (e.g. invalid UTF-8 in a string field)."""

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # grpc would answer INTERNAL; it is the caller's bad input
            return _Undecodable(str(exc) or type(exc).__name__)

    return parse


def _reject_undecodable(request: Any, context: grpc.ServicerContext) -> None:
    if isinstance(request, _Undecodable):
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request could not be parsed ({request.error}); string fields such as text and stop "
            "must be valid UTF-8",
        )


class ErrorMappingInterceptor(grpc.ServerInterceptor):
    def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        handler = handler._replace(request_deserializer=_lenient(handler.request_deserializer))
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                _reject_undecodable(request, context)
                try:
                    response = inner(request, context)
                except Exception as exc:
                    if _already_aborted(exc):
                        raise
                    _abort(context, exc, method)
                count_rpc(method, "OK")
                return response

            return handler._replace(unary_unary=unary)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                _reject_undecodable(request, context)
                try:
                    yield from inner_stream(request, context)
                except Exception as exc:
                    if _already_aborted(exc):
                        raise
                    _abort(context, exc, method)
                count_rpc(method, "OK")

            return handler._replace(unary_stream=stream)
        return handler


def _already_aborted(exc: BaseException) -> bool:
    # context.abort() raises a bare Exception subclass that must pass through untouched
    return type(exc).__name__ == "_AbortedRpc" or (type(exc) is Exception and not exc.args)
