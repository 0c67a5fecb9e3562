"""A streamed completion: server-sent events relayed from the choices' streams (docs/openai.md).

Per choice, one chunk per message of our gRPC stream (its text piece, held back near a stop string
by the orchestrator, so the pieces add up to the whole text), a last chunk with the finish reason,
a usage chunk when asked (stream_options.include_usage), then `data: [DONE]`.

This is the gateway's hot path: every streamed token of every client passes here. So a message goes
from the stream's `read()` (gateway/mux.py) to the ASGI `send` with no async generator, queue or
task between them for the common one-choice request, and the text-only chunk's JSON is framed once
per request. A client that goes away cancels its streams at once (the orchestrator frees their KV at
the next step), from a watcher of the connection rather than a task group around the writer
(docs/openai.md "Overhead").
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import grpc
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway import responses
from gateway.chat_output import ChatOutput
from gateway.errors import ApiError, from_grpc
from gateway.mux import MuxStream
from gateway.overhead import Clock
from gateway.upstream import Upstream
from moe_lightning.api.generation.v1 import generation_pb2

Message = generation_pb2.GenerateStreamResponse
Read = Any  # what `call.read()` returns: a Message, or grpc.aio.EOF once the stream ended


def sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


class EventStream(Response):
    """The ASGI response of a streamed completion or chat completion."""

    media_type = "text/event-stream"

    def __init__(
        self,
        upstream: Upstream,
        inputs: list[generation_pb2.GenerationInput],
        *,
        rid: str,
        model: str,
        chat: bool,
        top: int | None,
        n: int,  # choices per prompt: its usage counts each prompt once
        include_usage: bool,
        shapes: list[ChatOutput] | None = None,  # per choice, its reasoning and tool calls parsed out
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache"})
        self.upstream, self.inputs = upstream, inputs
        self.rid, self.model, self.chat, self.top, self.n = rid, model, chat, top, n
        self.include_usage = include_usage
        self.shapes = shapes
        self.created = responses.now()
        self.calls: list[MuxStream] = []
        self.gone = False  # the client closed the connection
        self.finals: dict[int, generation_pb2.GenerationOutput] = {}
        self.offsets = [0] * len(inputs)
        # a text-only piece is a chunk per token per stream: its JSON is framed once
        head = json.dumps(self._chunk([]), separators=(",", ":"))[: -len("[]}")] + "["
        frame = (
            '{"index":%d,"delta":{"content":%s},"finish_reason":null,"logprobs":null}]}'
            if chat
            else '{"index":%d,"text":%s,"finish_reason":null,"logprobs":null}]}'
        )
        self.frame = f"data: {head}{frame}\n\n"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        clock = Clock()
        self.calls = [self.upstream.stream(m) for m in self.inputs]
        watcher = asyncio.ensure_future(_disconnect(receive))
        watcher.add_done_callback(self._client_left)
        try:
            # each call's first message before the headers: what the orchestrator refuses at
            # submission (a bad input, a full queue) gets its own HTTP status, not a 200 and an event
            t0 = time.perf_counter()
            try:
                firsts = await asyncio.gather(*(c.read() for c in self.calls))
            except grpc.aio.AioRpcError as exc:
                await from_grpc(exc).response()(scope, receive, send)
                return
            except asyncio.CancelledError:
                if self.gone:  # our own cancel: the client left
                    return
                raise
            finally:
                clock.upstream += time.perf_counter() - t0
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            if self.chat:
                role = [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    for i in range(len(self.inputs))
                ]
                await _write(send, sse(self._chunk(role)))
            if len(self.calls) == 1:
                ended = await self._relay_one(send, clock, firsts[0])
            else:
                ended = await self._relay_many(send, clock, firsts)
            tail = b""  # the usage chunk, [DONE] and the end of the body go in one write
            if ended and self.include_usage:
                ordered = [self.finals[i] for i in sorted(self.finals)]
                tail = sse({**self._chunk([]), "usage": responses.usage(ordered, self.n)})
            if not self.gone:
                await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n", "more_body": False})
        finally:
            watcher.remove_done_callback(self._client_left)
            watcher.cancel()
            for call in self.calls:
                call.cancel()  # a no-op for a call that ended
            clock.observe()

    def _client_left(self, watcher: asyncio.Future[None]) -> None:
        if not watcher.cancelled():
            self.gone = True
            for call in self.calls:
                call.cancel()

    async def _relay_one(self, send: Send, clock: Clock, msg: Read) -> bool:
        """The one call's messages from its first, `msg`, each sent as it comes; whether the stream
        ended normally."""
        call = self.calls[0]
        while msg is not grpc.aio.EOF:
            await _write(send, self._event(0, msg))
            t0 = time.perf_counter()
            try:
                msg = await call.read()
            except asyncio.CancelledError:
                if self.gone:  # our own cancel: the client left
                    return False
                raise
            except grpc.aio.AioRpcError as exc:
                await _write(send, sse(from_grpc(exc).body()))
                return False
            finally:
                clock.upstream += time.perf_counter() - t0
        return True

    async def _relay_many(self, send: Send, clock: Clock, firsts: list[Read]) -> bool:
        """n > 1 or several prompts: every call read by a task of its own from its first message,
        relayed in arrival order."""
        queue: asyncio.Queue[tuple[int, Message | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, call: MuxStream, msg: Read) -> None:
            try:
                while msg is not grpc.aio.EOF:
                    queue.put_nowait((index, msg))
                    msg = await call.read()
                queue.put_nowait((index, None))
            except asyncio.CancelledError:
                if not self.gone:  # this task was cancelled, not its call
                    raise
                queue.put_nowait((index, None))
            except Exception as exc:
                queue.put_nowait((index, exc))

        tasks = [asyncio.ensure_future(pump(i, c, m)) for i, (c, m) in enumerate(zip(self.calls, firsts, strict=True))]
        try:
            open_calls = len(tasks)
            while open_calls:
                t0 = time.perf_counter()
                index, item = await queue.get()
                clock.upstream += time.perf_counter() - t0
                if self.gone:
                    return False
                if item is None:
                    open_calls -= 1
                elif isinstance(item, BaseException):
                    error = (
                        from_grpc(item)
                        if isinstance(item, grpc.aio.AioRpcError)
                        else ApiError(500, str(item), "internal_error")
                    )
                    await _write(send, sse(error.body()))
                    return False
                else:
                    await _write(send, self._event(index, item))
            return True
        finally:
            for t in tasks:
                t.cancel()

    def _event(self, index: int, msg: Message) -> bytes:
        """The chunk(s) of one gRPC message: its piece, then the finish reason if it is the last."""
        if self.shapes is not None:
            return self._shaped_event(index, msg, self.shapes[index])
        if msg.logprobs:
            out = sse(self._chunk([self._piece(index, msg.text, list(msg.logprobs))]))
        elif msg.text:
            out = (self.frame % (index, json.dumps(msg.text))).encode()
        else:
            out = b""
        self.offsets[index] += len(msg.text)
        if msg.HasField("output"):
            self.finals[index] = msg.output
            last: dict[str, Any] = {"index": index, "finish_reason": responses.FINISH.get(msg.output.finish_reason)}
            last |= {"delta": {}} if self.chat else {"text": ""}
            last["logprobs"] = None
            out += sse(self._chunk([last]))
        return out

    def _shaped_event(self, index: int, msg: Message, shape: ChatOutput) -> bytes:
        """A chat message's piece read for reasoning and tool calls: a chunk per delta (the piece's
        logprobs on the first), then, at the end, the finish reason (tool_calls when it called)."""
        deltas = shape.feed(msg.text) if msg.text else []
        last = msg.HasField("output")
        if last:
            deltas += shape.finish()
        lps = responses.chat_logprobs(list(msg.logprobs), self.top) if self.top is not None and msg.logprobs else None
        if lps is not None and not deltas:
            deltas = [{}]
        out = b""
        for i, delta in enumerate(deltas):
            piece = {"index": index, "delta": delta, "finish_reason": None, "logprobs": lps if i == 0 else None}
            out += sse(self._chunk([piece]))
        if last:
            self.finals[index] = msg.output
            finish = responses.FINISH.get(msg.output.finish_reason)
            if shape.called and finish == "stop":
                finish = "tool_calls"
            out += sse(self._chunk([{"index": index, "delta": {}, "finish_reason": finish, "logprobs": None}]))
        return out

    def _piece(self, index: int, text: str, lps: list) -> dict[str, Any]:
        if self.chat:
            out: dict[str, Any] = {"index": index, "delta": {"content": text}, "finish_reason": None}
            out["logprobs"] = responses.chat_logprobs(lps, self.top) if self.top is not None else None
        else:
            out = {"index": index, "text": text, "finish_reason": None}
            out["logprobs"] = responses.completion_logprobs(lps, self.offsets[index]) if self.top is not None else None
        return out

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return responses.chunk(self.rid, self.model, self.chat, choices, self.created)


async def _write(send: Send, data: bytes) -> None:
    if data:
        await send({"type": "http.response.body", "body": data, "more_body": True})


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
