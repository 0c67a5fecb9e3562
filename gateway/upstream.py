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


WHOLE = (1 << 32) - 1  # a stream_interval no request reaches: one message, the output


async def _output(stream: MuxStream) -> generation_pb2.GenerationOutput:
    output = None
    while (msg := await stream.read()) is not grpc.aio.EOF:
        output = msg.output if msg.HasField("output") else output
    assert output is not None  # a stream's last message carries it, else read() raised
    return output


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
        """Every input's output, all at once, as streams of one message each on the shared call: a
        unary call per input would pay gRPC's per-call cost (its own HTTP/2 stream, headers and
        trailers) for every request. Cancelling this cancels every stream."""
        streams = [self.mux.open(m, stream_interval=WHOLE) for m in inputs]
        try:
            return [await _output(s) for s in streams]
        finally:
            for s in streams:
                s.cancel()  # a no-op for those that ended

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
