"""Calling the other services: channels, waiting for SERVING, fetching the weight manifest."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_lightning.api.weight_store.v1 import weight_store_pb2, weight_store_pb2_grpc
from moe_lightning.service.convert import DTYPE_FROM_PB, spec_from_pb
from moe_lightning.service.errors import UnavailableError
from moe_lightning.service.names import WEIGHT_STORE
from moe_lightning.service.runtime import MAX_MESSAGE_BYTES
from moe_lightning.spec import ModelSpec

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # peers start and restart within seconds of each other: do not back off for long
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class _Stoppable(Protocol):
    @property
    def stopping(self) -> bool: ...


def open_channel(address: str, tls_ca: Path | None = None) -> grpc.Channel:
    if tls_ca is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
        return grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS)
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def health_status(channel: grpc.Channel, service: str, timeout: float = 1.0) -> int | None:
    """The health status enum of `service`, or None when the server does not answer."""
    try:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    except grpc.RpcError:
        return None
    return resp.status


def wait_serving(
    address: str, service: str, timeout: float = 600.0, stop: _Stoppable | None = None, poll: float = 0.2
) -> grpc.Channel:
    """Waits until `service` at `address` reports SERVING; returns an open channel to it."""
    channel = open_channel(address)
    deadline = time.monotonic() + timeout
    while True:
        if health_status(channel, service) == health_pb2.HealthCheckResponse.SERVING:
            return channel
        if stop is not None and stop.stopping:
            channel.close()
            raise UnavailableError(f"stopped while waiting for {service} at {address}")
        if time.monotonic() >= deadline:
            channel.close()
            raise UnavailableError(f"{service} at {address} was not SERVING within {timeout:.0f} s")
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
    return spec_from_pb(manifest.model), manifest


def arena_dtype(spec: ModelSpec, manifest: weight_store_pb2.GetManifestResponse) -> str:
    """The dtype the weight store serves (its --dtype, not the checkpoint's): what the device computes in."""
    return DTYPE_FROM_PB[manifest.pages[0].dtype] if manifest.pages else spec.dtype
