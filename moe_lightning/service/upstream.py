"""Calling the other services: channels, waiting for SERVING, fetching the weight manifest."""

from __future__ import annotations

import ssl
import time
from pathlib import Path
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_lightning.api.weight_store.v1 import weight_store_pb2, weight_store_pb2_grpc
from moe_lightning.service.auth import split_host, with_internal_token
from moe_lightning.service.limits import MAX_MESSAGE_BYTES
from moe_lightning.service.names import WEIGHT_STORE
from moe_lightning.spec import ModelSpec

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # peers start and restart within seconds of each other: do not back off for long
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# For a channel that polls a peer until it is SERVING: the peer is a process still importing torch,
# so every attempt fails until it listens, and the default backoff would then add up to a second to
# every start (a stack start waited ~0.8 s on average past the last service's SERVING). An attempt is
# one connect() on a loopback or unix socket: trying every 100 ms costs nothing.
POLLING_OPTIONS = [("grpc.max_reconnect_backoff_ms", 100)]


class _Stoppable(Protocol):
    @property
    def stopping(self) -> bool: ...


def open_channel(
    address: str, tls_ca: Path | None = None, options: list[tuple[str, Any]] | None = None
) -> grpc.Channel:
    """A channel to `address` (TLS verified against `tls_ca` when given) that carries this process's
    internal secret, if it has one, on every call."""
    opts = list({**dict(CHANNEL_OPTIONS), **dict(options or [])}.items())  # one value per key: `options` win
    if tls_ca is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
        channel = grpc.secure_channel(address, creds, options=opts)
    else:
        channel = grpc.insecure_channel(address, options=opts)
    return with_internal_token(channel)


def _cert_names(cert: Path) -> list[str]:
    """The DNS names and IP addresses a PEM certificate is for (subjectAltName, else its CN)."""
    try:
        decoded = ssl._ssl._test_decode_cert(str(cert))  # type: ignore[attr-defined]  # stdlib, no extra dependency
    except (AttributeError, OSError, ssl.SSLError):
        return []
    names = [v for k, v in decoded.get("subjectAltName", ()) if k in ("DNS", "IP Address")]
    if not names:
        names = [v for rdn in decoded.get("subject", ()) for k, v in rdn if k == "commonName"]
    return names


def readiness_channel(address: str, cert: Path, ca: Path | None = None) -> grpc.Channel:
    """A TLS channel from this machine to a public API bound at `address` with `cert`: a wildcard bind
    is reached on loopback, verified against `ca` (default: the certificate itself, right for a
    self-signed one) under a name the certificate is for, so a cert for api.example.com or one whose
    SAN lacks the bind address still passes the launcher's own health check."""
    host = split_host(address)
    port = address.rsplit(":", 1)[-1]
    target = f"127.0.0.1:{port}" if host in ("0.0.0.0", "::", "") else address
    names = _cert_names(cert)
    options = []
    if names and split_host(target) not in names:
        # a wildcard name matches any one label: put one in
        options.append(("grpc.ssl_target_name_override", names[0].replace("*", "readiness", 1)))
    return open_channel(target, tls_ca=ca or cert, options=[*POLLING_OPTIONS, *options])


def health_status(channel: grpc.Channel, service: str, timeout: float = 1.0) -> int | None:
    """The health status enum of `service`, or None when the server does not answer."""
    try:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    except grpc.RpcError:
        return None
    return resp.status


def _unavailable(message: str) -> Exception:
    # errors.py maps every domain error, torch's among them: the client and the launcher import this
    # module without torch, so it is imported when a wait fails, not before
    from moe_lightning.service.errors import UnavailableError

    return UnavailableError(message)


def wait_serving(
    address: str, service: str, timeout: float = 600.0, stop: _Stoppable | None = None, poll: float = 0.2
) -> grpc.Channel:
    """Waits until `service` at `address` reports SERVING; returns an open channel to it."""
    channel = open_channel(address, options=POLLING_OPTIONS)
    deadline = time.monotonic() + timeout
    while True:
        if health_status(channel, service) == health_pb2.HealthCheckResponse.SERVING:
            return channel
        if stop is not None and stop.stopping:
            channel.close()
            raise _unavailable(f"stopped while waiting for {service} at {address}")
        if time.monotonic() >= deadline:
            channel.close()
            raise _unavailable(f"{service} at {address} was not SERVING within {timeout:.0f} s")
        time.sleep(poll)


def fetch_manifest(
    address: str, timeout: float = 600.0, stop: _Stoppable | None = None
) -> tuple[ModelSpec, weight_store_pb2.GetManifestResponse]:
    channel = wait_serving(address, WEIGHT_STORE, timeout, stop)
    try:
        manifest = weight_store_pb2_grpc.WeightStoreStub(channel).GetManifest(
            weight_store_pb2.GetManifestRequest(), timeout=30
        )
    finally:
        channel.close()
    from moe_lightning.service.convert import spec_from_pb  # torch: not for a client or the launcher

    return spec_from_pb(manifest.model), manifest


def arena_dtype(spec: ModelSpec, manifest: weight_store_pb2.GetManifestResponse) -> str:
    """The dtype the weight store serves (its --dtype, not the checkpoint's): what the device computes in."""
    from moe_lightning.service.convert import DTYPE_FROM_PB

    return DTYPE_FROM_PB[manifest.pages[0].dtype] if manifest.pages else spec.dtype


def http_ready(base_url: str, tls_ca: Path | None = None, timeout: float = 0.5) -> bool:
    """Whether an HTTP service answers 200 on /health (the gateway's readiness); over TLS the chain is
    checked against `tls_ca`, not the name (the launcher probes its own child on its own address)."""
    import urllib.error
    import urllib.request

    context = None
    if base_url.startswith("https:"):
        context = ssl.create_default_context(cafile=str(tls_ca) if tls_ca else None)
        context.check_hostname = False
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout, context=context) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def arena_page_copies(manifest: weight_store_pb2.GetManifestResponse, names: list[str]) -> list[Any]:
    """Copies (torch tensors) of the named pages of the weight store's arena, read once at start: the few
    small weights a service that computes no layer needs (cpu_attention's attention sinks)."""
    from moe_lightning.arena import view
    from moe_lightning.service.convert import layout_from_pb
    from moe_lightning.shm.segment import Segment

    layout = layout_from_pb(list(manifest.pages), manifest.region_bytes)
    missing = [n for n in names if n not in layout.pages]
    if missing:
        raise ValueError(f"the weight store's arena has no page {missing[0]!r}")
    arena = Segment.attach(manifest.region)
    try:
        return [view(arena.bytes(), layout.pages[n]).clone() for n in names]
    finally:
        arena.close()
