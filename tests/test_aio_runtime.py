"""The asyncio API server's interceptors (moe_lightning/service/aio_runtime.py), in process: the bearer
token guards unary and streaming calls alike while health needs none, and a domain error becomes its
documented status on either kind of call."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from moe_lightning.api.generation.v1 import generation_pb2, generation_pb2_grpc
from moe_lightning.client import Prompt
from moe_lightning.service.aio_runtime import AioBearerTokenInterceptor, AioErrorMappingInterceptor
from moe_lightning.service.concurrency import AioConcurrencyLimit
from moe_lightning.service.names import GENERATION
from orchestrator.api import GenerationServicer

TOKEN = "s3cret-token"
CALLS = {
    "Generate": generation_pb2.GenerateRequest(input=Prompt(token_ids=[1]).to_pb()),
    "GenerateStream": generation_pb2.GenerateStreamRequest(input=Prompt(token_ids=[1]).to_pb()),
    "BatchGenerate": generation_pb2.BatchGenerateRequest(inputs=[Prompt(token_ids=[1]).to_pb()]),
    "GetServerMetadata": generation_pb2.GetServerMetadataRequest(),
}


async def _call(stub: generation_pb2_grpc.GenerationStub, name: str, metadata: tuple) -> grpc.StatusCode:
    try:
        call = getattr(stub, name)(CALLS[name], metadata=metadata, timeout=10)
        if name == "GenerateStream":
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            assert "authorization: Bearer" in (exc.details() or "")
        return exc.code()
    return grpc.StatusCode.OK


async def _exercise() -> dict[str, dict[str, grpc.StatusCode]]:
    server = grpc.aio.server(interceptors=(AioBearerTokenInterceptor(TOKEN), AioErrorMappingInterceptor()))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(), server)  # no scheduler yet
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    seen: dict[str, dict[str, grpc.StatusCode]] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            for who, metadata in [
                ("none", ()),
                ("wrong", (("authorization", "Bearer nope"),)),
                ("right", (("authorization", f"Bearer {TOKEN}"),)),
            ]:
                seen[who] = {name: await _call(stub, name, metadata) for name in CALLS}
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            seen["health"] = {"Check": grpc.StatusCode.OK if reply.status == 1 else grpc.StatusCode.UNKNOWN}
    finally:
        await server.stop(None)
    return seen


def test_the_token_guards_every_kind_of_call_and_errors_keep_their_status() -> None:
    seen = asyncio.run(_exercise())
    for who in ("none", "wrong"):
        assert set(seen[who].values()) == {grpc.StatusCode.UNAUTHENTICATED}, (who, seen[who])
    # with the token: the servicer's NotReadyError ("still starting") is FAILED_PRECONDITION, unary or streamed
    assert set(seen["right"].values()) == {grpc.StatusCode.FAILED_PRECONDITION}, seen["right"]
    assert seen["health"] == {"Check": grpc.StatusCode.OK}


def test_an_empty_token_is_refused() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        AioBearerTokenInterceptor("")


async def _watch_changes() -> list[int]:
    """A client's health Watch through every interceptor the API server has, while the status flips."""
    limit = AioConcurrencyLimit(1, "--max-concurrent-rpcs")
    server = grpc.aio.server(interceptors=(AioBearerTokenInterceptor(TOKEN), AioErrorMappingInterceptor(), limit))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health.set(GENERATION, health_pb2.HealthCheckResponse.SERVING)
    seen: list[int] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=GENERATION), timeout=10)
            async for reply in call:
                seen.append(reply.status)
                if len(seen) == 3:
                    break
                await health.set(GENERATION, [2, 1][len(seen) - 1])  # NOT_SERVING, then SERVING again
            call.cancel()
    finally:
        await server.stop(None)
    return seen


def test_a_health_watch_streams_every_change() -> None:
    # grpc's Watch writes with context.write: the interceptors once wrapped it as a generator and
    # every Watch failed with INTERNAL (gRPC clients' own health checking uses Watch)
    assert asyncio.run(_watch_changes()) == [1, 2, 1]
