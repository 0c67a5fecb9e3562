"""The gateway's side of the gRPC Generation API (grpc.aio: a waiting request holds no thread)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.mux import Mux, MuxStream
from moe_lightning.api.common.v1 import common_pb2
from moe_lightning.api.generation.v1 import generation_pb2, generation_pb2_grpc
from moe_lightning.service.limits import MAX_MESSAGE_BYTES
from moe_lightning.service.names import GENERATION

OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


class Upstream:
    def __init__(self, address: str, tls_ca: Path | None = None, token: str | None = None) -> None:
        if tls_ca is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=tls_ca.read_bytes())
            self.channel = grpc.aio.secure_channel(address, creds, options=OPTIONS)
        else:
            self.channel = grpc.aio.insecure_channel(address, options=OPTIONS)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.mux = Mux(self.stub, self.metadata)

    async def generate_all(self, inputs: list[generation_pb2.GenerationInput]) -> list[generation_pb2.GenerationOutput]:
        """One Generate per input, all at once (cancelling this cancels every call). Unary, not a
        stream on the shared call: the orchestrator then does no per-token work for it."""
        calls = [self.stub.Generate(generation_pb2.GenerateRequest(input=m), metadata=self.metadata) for m in inputs]
        return [r.output for r in await asyncio.gather(*calls)]

    def stream(self, m: generation_pb2.GenerationInput) -> MuxStream:
        """A started stream, read and cancelled as a GenerateStream call is, on the shared
        GenerateStreams call (gateway/mux.py)."""
        return self.mux.open(m)

    async def serving(self, timeout: float = 1.0) -> bool:
        try:
            r = await self.health.Check(health_pb2.HealthCheckRequest(service=GENERATION), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING

    async def model_info(self, timeout: float) -> common_pb2.ModelInfo:
        """Waits until the API answers (the stack may still be starting)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                r = await self.stub.GetModelInfo(
                    generation_pb2.GetModelInfoRequest(), metadata=self.metadata, timeout=5
                )
                return r.model
            except grpc.aio.AioRpcError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def close(self) -> None:
        await self.mux.close()
        await self.channel.close()
