"""Every streamed choice of every HTTP client on one GenerateStreams call (docs/api.md, "Many streams
on one call"; docs/openai.md, "Overhead").

One GenerateStream per choice would cost a gRPC message per stream per decode step, on the gateway
and on the orchestrator alike; on the shared call a step's pieces for all of them come in one
message, and one reader task hands each piece to its stream. A `MuxStream` reads and cancels like a
GenerateStream call (`read()` gives the messages, then grpc.aio.EOF; a failed stream raises the
AioRpcError its own call would have), so the HTTP side does not know the difference.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog

from moe_lightning.api.generation.v1 import generation_pb2, generation_pb2_grpc

CODES = {c.value[0]: c for c in grpc.StatusCode}


class MuxStream:
    """One stream on the shared call."""

    def __init__(self, mux: Mux, sid: int) -> None:
        self.mux, self.sid = mux, sid
        self.queue: deque[Any] = deque()  # messages, then EOF or the stream's error
        self.waiter: asyncio.Future[None] | None = None
        self.ended = False  # its last item is queued
        self.cancelled = False

    def deliver(self, item: Any, last: bool = False) -> None:
        self.queue.append(item)
        self.ended = self.ended or last
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def read(self) -> Any:
        """The next message, grpc.aio.EOF after the last; raises the stream's AioRpcError, or
        CancelledError once cancel() was called, as a cancelled call's read does."""
        while not self.queue:
            if self.cancelled:
                raise asyncio.CancelledError
            if self.ended:  # read past the end, as a finished call's read
                return grpc.aio.EOF
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        item = self.queue.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        """Stops the request at the orchestrator's next step; a no-op once the stream ended."""
        if self.ended or self.cancelled:
            return
        self.cancelled = True
        self.mux.cancel(self.sid)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class Mux:
    """The shared GenerateStreams call, started on first use and again after it failed (say the
    orchestrator restarted: its open streams get that error, new ones get a new call)."""

    def __init__(self, stub: generation_pb2_grpc.GenerationStub, metadata: tuple[tuple[str, str], ...]) -> None:
        self.stub, self.metadata = stub, metadata
        self.outbox: asyncio.Queue[generation_pb2.GenerateStreamsRequest] | None = None
        self.streams: dict[int, MuxStream] = {}
        self.reader: asyncio.Task[None] | None = None
        self.next_id = 1

    def open(self, m: generation_pb2.GenerationInput) -> MuxStream:
        if self.outbox is None:
            self._start()
        assert self.outbox is not None
        stream = MuxStream(self, self.next_id)
        self.next_id += 1
        self.streams[stream.sid] = stream
        start = generation_pb2.GenerateStreamRequest(input=m)
        self.outbox.put_nowait(generation_pb2.GenerateStreamsRequest(id=stream.sid, start=start))
        return stream

    def cancel(self, sid: int) -> None:
        if self.streams.pop(sid, None) is not None and self.outbox is not None:
            self.outbox.put_nowait(generation_pb2.GenerateStreamsRequest(id=sid, cancel=True))

    def _start(self) -> None:
        outbox: asyncio.Queue[generation_pb2.GenerateStreamsRequest] = asyncio.Queue()

        async def requests() -> AsyncIterator[generation_pb2.GenerateStreamsRequest]:
            while True:
                yield await outbox.get()

        call = self.stub.GenerateStreams(requests(), metadata=self.metadata)  # before the outbox is ours
        self.outbox, self.streams = outbox, {}
        self.reader = asyncio.ensure_future(self._read(call, outbox, self.streams))

    async def _read(
        self,
        call: grpc.aio.StreamStreamCall,
        outbox: asyncio.Queue[generation_pb2.GenerateStreamsRequest],
        streams: dict[int, MuxStream],
    ) -> None:
        code, details = grpc.StatusCode.UNAVAILABLE, "the API ended the streams call"
        try:
            async for response in call:
                for piece in response.pieces:
                    stream = streams.get(piece.id)
                    if stream is None:  # cancelled: its last pieces may still come
                        continue
                    if piece.HasField("error"):
                        error = CODES.get(piece.error.code, grpc.StatusCode.UNKNOWN)
                        stream.deliver(grpc.aio.AioRpcError(error, details=piece.error.message), last=True)
                        del streams[piece.id]
                    elif piece.message.HasField("output"):
                        stream.deliver(piece.message)
                        stream.deliver(grpc.aio.EOF, last=True)
                        del streams[piece.id]
                    else:
                        stream.deliver(piece.message)
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or exc.code().name
        except asyncio.CancelledError:  # close(): the gateway is stopping
            code, details = grpc.StatusCode.UNAVAILABLE, "the gateway is stopping"
        except Exception as exc:  # a bug here must fail the streams, not leave their clients waiting
            structlog.get_logger().error("streams_call_reader_failed", exc_info=exc)
            code, details = grpc.StatusCode.INTERNAL, f"the gateway's stream reader failed: {exc}"
        finally:
            if self.outbox is outbox:  # the next stream starts a new call
                self.outbox = None
            call.cancel()
        if streams:
            structlog.get_logger().warning("streams_call_ended", code=code.name, open_streams=len(streams))
        for stream in streams.values():  # an error each: raised in each stream's own task
            stream.deliver(grpc.aio.AioRpcError(code, details=details), last=True)
        streams.clear()

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
            await asyncio.gather(self.reader, return_exceptions=True)
