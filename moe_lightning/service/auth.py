"""Who may call a service.

The public API (the orchestrator): TLS and a bearer token. The internal services (weight store,
gpu_expert, cpu_attention): a unix socket in a private directory by default; on TCP a shared secret
(`--internal-token`) that every caller sends as `x-moe-lightning-internal` metadata, because on
TCP any local user can reach the port. Health and reflection stay open everywhere: probes carry no
secrets and reveal none.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import structlog

from moe_lightning.private_paths import UnsafePathError, private_dir

# probes and tooling must work without the token: a health check carries no secrets
EXEMPT_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")
INTERNAL_METADATA_KEY = "x-moe-lightning-internal"
INTERNAL_TOKEN_ENV = "MOE_LIGHTNING_INTERNAL_TOKEN"


def server_credentials(cert: Path, key: Path) -> grpc.ServerCredentials:
    try:
        return grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    except OSError as exc:
        raise ValueError(f"cannot read the TLS certificate or key: {exc}") from exc


def _denied(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """`handler` with whichever of its four behaviours gRPC will call replaced by one that aborts:
    replacing only the unary-request ones would let a client-streaming method through untouched."""

    def deny(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kind = {
        (False, False): "unary_unary",
        (False, True): "unary_stream",
        (True, False): "stream_unary",
        (True, True): "stream_stream",
    }[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return handler._replace(**{kind: deny})  # type: ignore[attr-defined]


def bearer_matches(value: str | bytes, token: str) -> bool:
    """Whether `value`, an Authorization header or metadata value, carries `token` under the Bearer
    scheme. The scheme's name is case-insensitive (RFC 7235 section 2.1: `bearer` and `BEARER` are
    `Bearer`); the token is compared exactly, in constant time."""
    raw = value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")
    scheme, _, credentials = raw.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.lstrip(b" "), token.encode())


class _MetadataTokenInterceptor(grpc.ServerInterceptor):
    """Requires metadata `key` to equal `expected` on every call but health and reflection."""

    def __init__(self, key: str, expected: str, message: str) -> None:
        self._key, self._expected, self._message = key, expected.encode(), message

    def _matches(self, got: bytes) -> bool:
        return hmac.compare_digest(got, self._expected)

    def _ok(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> bool:
        for key, value in metadata or ():
            if key == self._key:
                return self._matches(value if isinstance(value, bytes) else value.encode())
        return False

    def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith(EXEMPT_PREFIXES) or self._ok(details.invocation_metadata):
            return continuation(details)
        handler = continuation(details)
        return None if handler is None else _denied(handler, self._message)


class BearerTokenInterceptor(_MetadataTokenInterceptor):
    """Requires `authorization: Bearer <token>` metadata on every call but health and reflection (the
    scheme in any case, as HTTP's: `bearer_matches`)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the auth token must not be empty")
        super().__init__(
            "authorization",
            f"Bearer {token}",
            "missing or wrong bearer token: send metadata 'authorization: Bearer <token>'",
        )
        self._token = token

    def _matches(self, got: bytes) -> bool:
        return bearer_matches(got, self._token)


class InternalTokenInterceptor(_MetadataTokenInterceptor):
    """Requires the internal services' shared secret (sent by `with_internal_token`)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the internal token must not be empty")
        super().__init__(
            INTERNAL_METADATA_KEY,
            token,
            f"missing or wrong internal token: internal services take calls only from a process started "
            f"with the same --internal-token ({INTERNAL_TOKEN_ENV})",
        )


# The internal services' shared secret this process sends (set once at start-up by
# internal_guard from --internal-token); None: send nothing.
_internal_token: str | None = None


def set_internal_token(token: str | None) -> None:
    global _internal_token
    _internal_token = token or None


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _SendInternalToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the internal secret to every call of every kind on a channel."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [*(d.metadata or ()), (INTERNAL_METADATA_KEY, self._token)]
        return _CallDetails(
            d.method, d.timeout, metadata, d.credentials, getattr(d, "wait_for_ready", None), d.compression
        )

    def _call(self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)

    intercept_unary_unary = intercept_unary_stream = _call
    intercept_stream_unary = intercept_stream_stream = _call


def with_internal_token(channel: grpc.Channel) -> grpc.Channel:
    """`channel` sending this process's internal secret, if it has one, on every call (what
    `upstream.open_channel` gives every channel it opens)."""
    if _internal_token:
        return grpc.intercept_channel(channel, _SendInternalToken(_internal_token))
    return channel


def is_unix(address: str) -> bool:
    return address.startswith(("unix:", "unix-abstract:"))


def split_host(address: str) -> str:
    """The host part of a gRPC target: 'dns:///h:1', 'ipv4:h:1', '[::1]:1', 'h:1', 'h' -> h."""
    target = address.split("///", 1)[-1] if "///" in address else address
    for scheme in ("ipv4:", "ipv6:", "dns:"):
        target = target.removeprefix(scheme)
    if target.startswith("["):
        return target[1 : target.find("]")]
    return target.rsplit(":", 1)[0] if target.count(":") == 1 else target


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: reachable from this machine only."""
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local_target(address: str) -> bool:
    """A target a client reaches without leaving this machine: a unix socket, loopback, or the
    unspecified address (connecting to 0.0.0.0 or :: reaches this host)."""
    if is_unix(address):
        return True
    host = split_host(address)
    return is_loopback(host) or host in ("0.0.0.0", "::", "")


def ensure_private_dir(path: Path) -> Path:
    """The default socket directory, made private (moe_lightning/private_paths.py): another user who
    created it first could replace our sockets with their own listeners."""
    try:
        return private_dir(path)
    except UnsafePathError as exc:
        raise UnsafePathError(f"{exc}; remove it, or give --address unix:///a/directory/of/yours/NAME.sock") from None


def internal_guard(args: Any, service: str) -> tuple[grpc.ServerInterceptor, ...]:
    """What `runtime.bootstrap` installs for `service`: refuses an internal service on TCP without a
    shared secret (SystemExit, saying how to fix it), makes the default socket directory private,
    sets the secret this process sends to the services it calls, and returns the interceptor that
    checks it (none without a secret)."""
    from moe_lightning.config.service import default_socket_dir
    from moe_lightning.service.names import GENERATION

    token = getattr(args, "internal_token", None) or None
    set_internal_token(token)
    address = str(getattr(args, "address", ""))
    if service == GENERATION:
        # the public API has its own TLS and bearer token (the internal secret is only sent on); a
        # hand-started one may be meant for a trusted network, so a wide-open bind is a warning here
        # (`up` refuses it without --insecure)
        if not is_unix(address) and not is_loopback(split_host(address)) and not getattr(args, "auth_token", None):
            structlog.get_logger().warning(
                "public_api_without_token", address=address, fix="set MOE_LIGHTNING_AUTH_TOKEN (and --tls-cert)"
            )
        return ()
    if is_unix(address):
        sock = Path(address.removeprefix("unix:").removeprefix("//"))
        if sock.parent == default_socket_dir():
            try:
                ensure_private_dir(sock.parent)
            except PermissionError as exc:
                raise SystemExit(f"error: {exc}") from None
    elif not token:
        raise SystemExit(
            f"error: {service} would listen on TCP ({address}) without authentication, where any local user "
            f"could call it: set a shared secret with {INTERNAL_TOKEN_ENV} (or --internal-token) here and on "
            "every service that calls it, or listen on a unix socket (the default: drop --address)"
        )
    return (InternalTokenInterceptor(token),) if token else ()
