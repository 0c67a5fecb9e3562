"""The gateway's side of the gRPC Generation API (grpc.aio: a waiting request holds no thread)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import from_grpc
from gateway.mux import Mux, MuxStream
from moe_lightning.api.common.v1 import common_pb2
from moe_lightning.api.generation.v1 import generation_pb2, generation_pb2_grpc
from moe_lightning.service.limits import MAX_MESSAGE_BYTES
from moe_lightning.service.names import GENERATION
from moe_lightning.validation import MAX_BATCH_PROMPTS

OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


BATCH_ROW = re.compile(r"input (\d+): (.*)", re.DOTALL)


def batch_row_name(details: str, inputs: int, choices: int) -> str:
    """BatchGenerate names a refused row by its index among the inputs (`input 7: ...`), which are a
    request's prompts x n choices here: the client sees the prompt's index, or none for one prompt."""
    m = BATCH_ROW.fullmatch(details)
    if m is None:
        return details
    row, rest = int(m.group(1)), m.group(2)
    return f"prompt {row // choices}: {rest}" if inputs > choices else rest


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
        # a request's prompts x n at most (its inputs are one BatchGenerate); the server's own, read
        # at start (model_info), until then the orchestrator's constant
        self.max_batch_prompts = MAX_BATCH_PROMPTS
        # how the model writes tool calls and reasoning ("": not at all), the server's, read at start
        self.tool_call_format = ""
        self.reasoning_format = ""

    async def generate_all(
        self, inputs: list[generation_pb2.GenerationInput], choices: int = 1
    ) -> list[generation_pb2.GenerationOutput]:
        """A request's inputs in one call: Generate for one, BatchGenerate for more (so a list is one
        call however long, and cancelling it cancels every input; one unary call per input made a
        list of thousands as many concurrent calls). Unary, not a stream on the shared call: the
        orchestrator then does no per-token work for it. `choices`: inputs per prompt (n), to name
        the prompt of a refusal in the client's terms."""
        if len(inputs) == 1:
            r = await self.stub.Generate(generation_pb2.GenerateRequest(input=inputs[0]), metadata=self.metadata)
            return [r.output]
        try:
            batch = await self.stub.BatchGenerate(
                generation_pb2.BatchGenerateRequest(inputs=inputs), metadata=self.metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc, batch_row_name(exc.details() or "", len(inputs), choices)) from None
        return list(batch.outputs)

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
        """Waits until the API answers (the stack may still be starting); reads its limits too."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                r = await self.stub.GetModelInfo(
                    generation_pb2.GetModelInfoRequest(), metadata=self.metadata, timeout=5
                )
                meta = await self.stub.GetServerMetadata(
                    generation_pb2.GetServerMetadataRequest(), metadata=self.metadata, timeout=5
                )
                self.max_batch_prompts = meta.max_batch_prompts or MAX_BATCH_PROMPTS  # 0: a server that does not say
                self.tool_call_format, self.reasoning_format = meta.tool_call_format, meta.reasoning_format
                return r.model
            except grpc.aio.AioRpcError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def close(self) -> None:
        await self.mux.close()
        await self.channel.close()
