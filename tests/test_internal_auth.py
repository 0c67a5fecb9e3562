"""Issue 14, items 3 and 14: the internal services are not open to every local user, and a token
interceptor guards every kind of method (a client-streaming call used to slip past it)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from moe_lightning.api.gpu_expert.v1 import gpu_expert_pb2, gpu_expert_pb2_grpc
from moe_lightning.api.weight_store.v1 import weight_store_pb2, weight_store_pb2_grpc
from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.config.service import default_socket_dir
from moe_lightning.launcher import Stack, free_port
from moe_lightning.service import upstream
from moe_lightning.service.auth import (
    INTERNAL_METADATA_KEY,
    BearerTokenInterceptor,
    InternalTokenInterceptor,
    ensure_private_dir,
    set_internal_token,
)
from moe_lightning.service.names import WEIGHT_STORE
from moe_lightning.service.upstream import health_status, open_channel

from reference import E2E_PROMPTS as PROMPTS

SECRET = "internal-s3cret"
KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def _echo_server(interceptor: grpc.ServerInterceptor) -> tuple[grpc.Server, str]:
    """A server with one method of each of the four kinds (bytes in, bytes out) behind `interceptor`."""

    def uu(req: bytes, _ctx: grpc.ServicerContext) -> bytes:
        return req

    def us(req: bytes, _ctx: grpc.ServicerContext) -> Iterator[bytes]:
        yield req

    def su(reqs: Iterator[bytes], _ctx: grpc.ServicerContext) -> bytes:
        return b"".join(reqs)

    def ss(reqs: Iterator[bytes], _ctx: grpc.ServicerContext) -> Iterator[bytes]:
        yield from reqs

    handlers = {
        "unary_unary": grpc.unary_unary_rpc_method_handler(uu),
        "unary_stream": grpc.unary_stream_rpc_method_handler(us),
        "stream_unary": grpc.stream_unary_rpc_method_handler(su),
        "stream_stream": grpc.stream_stream_rpc_method_handler(ss),
    }
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=(interceptor,))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", handlers),))
    hs = health.HealthServicer()
    hs.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _call(channel: grpc.Channel, kind: str, metadata: tuple[tuple[str, str], ...] | None) -> bytes:
    method = getattr(channel, kind)(f"/test.Echo/{kind}")
    if kind.startswith("unary"):
        result = method(b"hi", timeout=10, metadata=metadata)
    else:
        result = method(iter([b"h", b"i"]), timeout=10, metadata=metadata)
    return result if isinstance(result, bytes) else b"".join(result)


@pytest.mark.parametrize(
    ("interceptor", "good"),
    [
        (BearerTokenInterceptor("tok"), (("authorization", "Bearer tok"),)),
        (InternalTokenInterceptor(SECRET), ((INTERNAL_METADATA_KEY, SECRET),)),
    ],
    ids=["bearer", "internal"],
)
def test_token_interceptors_guard_every_kind_of_method(
    interceptor: grpc.ServerInterceptor, good: tuple[tuple[str, str], ...]
) -> None:
    server, addr = _echo_server(interceptor)
    try:
        with grpc.insecure_channel(addr) as ch:
            for kind in KINDS:
                for bad in (None, ((good[0][0], "wrong"),)):
                    with pytest.raises(grpc.RpcError) as info:
                        _call(ch, kind, bad)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (kind, bad)
                assert _call(ch, kind, good) == b"hi", kind
            assert health_status(ch, "") == health_pb2.HealthCheckResponse.SERVING  # probes need no secret
    finally:
        server.stop(0)


def test_open_channel_sends_the_internal_secret_on_every_kind() -> None:
    """What the orchestrator's Backend and the workers' manifest fetch use: open_channel carries the
    process's secret once auth.internal_guard set it at start-up."""
    server, addr = _echo_server(InternalTokenInterceptor(SECRET))
    try:
        set_internal_token(SECRET)
        with open_channel(addr) as ch:
            for kind in KINDS:
                assert _call(ch, kind, None) == b"hi", kind
    finally:
        set_internal_token(None)
        server.stop(0)


@pytest.mark.parametrize("module", ["services.weight_store", "services.gpu_expert", "services.cpu_attention"])
def test_internal_service_refuses_tcp_without_a_secret(module: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MOE_LIGHTNING_INTERNAL_TOKEN"}
    own = ["--model", str(tmp_path)] if module.endswith("weight_store") else ["--weight-store", "unix:///nowhere"]
    r = subprocess.run(
        [sys.executable, "-m", module, "--address", f"127.0.0.1:{free_port()}", "--run-id", "t14noauth", *own],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "MOE_LIGHTNING_INTERNAL_TOKEN" in r.stderr and "unix socket" in r.stderr, r.stderr


def test_internal_service_on_tcp_requires_its_secret(hf_dir: Path, tmp_path: Path) -> None:
    addr = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "services.weight_store", "--address", addr, "--model", str(hf_dir)]
    cmd += ["--run-id", f"t14auth{os.getpid()}", "--cache-dir", str(tmp_path / "cache"), "--no-progress"]
    env = {**os.environ, "MOE_LIGHTNING_INTERNAL_TOKEN": SECRET}  # by environment: argv is public
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        ch = grpc.insecure_channel(addr)
        deadline = time.monotonic() + 120
        while health_status(ch, WEIGHT_STORE) != health_pb2.HealthCheckResponse.SERVING:  # health stays open
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "weight store not SERVING"
            time.sleep(0.2)
        stub = weight_store_pb2_grpc.WeightStoreStub(ch)
        for metadata in (None, ((INTERNAL_METADATA_KEY, "wrong"),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.GetManifest(weight_store_pb2.GetManifestRequest(), timeout=30, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "--internal-token" in info.value.details()
        ch.close()
        set_internal_token(SECRET)
        spec, manifest = upstream.fetch_manifest(addr, timeout=30)
        assert manifest.pages and spec.num_layers > 0
    finally:
        set_internal_token(None)
        proc.terminate()
        proc.wait(30)
    assert proc.returncode == 0


def test_stack_with_internal_services_on_tcp(
    reference: dict, make_stack: Callable[..., Stack], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole stack with its internal services on TCP: every service sends the secret to the ones it
    calls (the orchestrator's Backend, the workers' manifest fetch), so it serves; a caller without
    the secret gets UNAUTHENTICATED from gpu_expert's Connect and the weight store."""
    monkeypatch.setenv("MOE_LIGHTNING_INTERNAL_TOKEN", SECRET)  # inherited by the four services
    stack = make_stack(start=False, kv_cache_memory="16MiB", max_batch_size=None)
    stack.prepare()
    for name in ("weight_store", "gpu_expert", "cpu_attention"):
        stack.addresses[name] = f"127.0.0.1:{free_port()}"
    stack.spawn(stack.services)
    stack.wait_ready(120)
    with GenerationClient(stack.api_address, timeout=60) as c:
        assert c.generate(Prompt(token_ids=PROMPTS[0], max_new_tokens=14)).token_ids == reference[0]
    with grpc.insecure_channel(stack.addresses["gpu_expert"]) as ch, pytest.raises(grpc.RpcError) as info:
        gpu_expert_pb2_grpc.GpuExpertStub(ch).Connect(gpu_expert_pb2.ConnectRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(stack.addresses["weight_store"]) as ch, pytest.raises(grpc.RpcError) as info:
        weight_store_pb2_grpc.WeightStoreStub(ch).GetManifest(weight_store_pb2.GetManifestRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_internal_services_default_to_a_private_unix_socket() -> None:
    from services.cpu_attention.server import build_parser as attn
    from services.gpu_expert.server import build_parser as gpu
    from services.weight_store.server import build_parser as ws

    for name, parser, argv in [
        ("weight_store", ws(), ["--model", "m"]),
        ("gpu_expert", gpu(), ["--weight-store", "unix:///x"]),
        ("cpu_attention", attn(), ["--weight-store", "unix:///x"]),
    ]:
        assert parser.parse_args(argv).address == f"unix://{default_socket_dir() / f'{name}.sock'}"


def test_private_dir_refuses_one_that_is_not_ours(tmp_path: Path) -> None:
    mine = ensure_private_dir(tmp_path / "new")
    assert (mine.stat().st_mode & 0o777) == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # what another user creating it first would leave
    with pytest.raises(PermissionError, match="as a private directory"):
        ensure_private_dir(open_dir)
    link = tmp_path / "link"
    link.symlink_to(mine)
    with pytest.raises(PermissionError):
        ensure_private_dir(link)
    if os.getuid() == 0:  # a directory another user owns, even mode 0700
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(PermissionError, match="owned by uid 65534"):
            ensure_private_dir(theirs)
