"""Exposure of the public API: TLS and a bearer token (the internal services listen on unix sockets
or loopback and need neither)."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

# probes and tooling must work without the token: a health check carries no secrets
EXEMPT_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


def server_credentials(cert: Path, key: Path) -> grpc.ServerCredentials:
    try:
        return grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    except OSError as exc:
        raise ValueError(f"cannot read the TLS certificate or key: {exc}") from exc


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Requires `authorization: Bearer <token>` metadata on every call but health and reflection."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the auth token must not be empty")
        self._expected = f"Bearer {token}".encode()

    def _ok(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                got = value if isinstance(value, bytes) else value.encode()
                return hmac.compare_digest(got, self._expected)
        return False

    def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith(EXEMPT_PREFIXES) or self._ok(details.invocation_metadata):
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong bearer token: send metadata 'authorization: Bearer <token>'",
            )

        if handler.unary_stream is not None:
            return handler._replace(unary_stream=deny)
        return handler._replace(unary_unary=deny)
