"""GenerateStreams: many GenerateStreams on one call (docs/api.md, "Many streams on one call").

A front end that serves many clients (the HTTP gateway) would otherwise hold one GenerateStream per
client, and every decode step would cost one gRPC message per stream on both sides: in this
Python stack that per-message cost, not the bytes, is what a stream costs (docs/openai.md,
"Overhead"). Here each stream is the very GenerateStream handler, run as a task of this call, so its
messages are exactly the ones GenerateStream sends (intervals, held-back stop text, the output on
the last); what changes is the framing: every stream's messages ready at the time go out together
in one GenerateStreamsResponse, as vLLM's engine hands its front end a whole step's outputs at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from moe_lightning.api.generation.v1 import generation_pb2
from moe_lightning.request import InvalidRequestError
from moe_lightning.service.errors import _Undecodable, rejection
from moe_lightning.service.limits import MAX_MESSAGE_BYTES

METHOD = "/moe_lightning.api.generation.v1.Generation/GenerateStreams"
# a response's pieces at most, by count and by size: a reader that fell far behind, or several large
# outputs done in one step, get several messages, each sendable (a single GenerateStream message
# is bounded by what validation admits, well under the limit)
MAX_PIECES = 4096
MAX_RESPONSE_BYTES = MAX_MESSAGE_BYTES // 4
IDLE_CHECK_SECONDS = 0.5  # how soon an idle call ends once the server is stopping

Stream = Callable[[generation_pb2.GenerateStreamRequest], AsyncIterator[generation_pb2.GenerateStreamResponse]]
Out = tuple[int, generation_pb2.GenerateStreamResponse | generation_pb2.StreamError | None]


async def generate_streams(
    requests: AsyncIterator[generation_pb2.GenerateStreamsRequest], stream: Stream, stopping: Callable[[], bool]
) -> AsyncIterator[generation_pb2.GenerateStreamsResponse]:
    """`stream(request)`: one stream's messages (the servicer's GenerateStream). Ends when the client
    has half-closed and every stream ended, or when the server is `stopping()` and no stream is
    open (a front end's idle call must not hold up the drain); the call's cancellation cancels
    every stream."""
    out: asyncio.Queue[Out] = asyncio.Queue()
    tasks: dict[int, asyncio.Task[None]] = {}
    cancelled: set[int] = set()  # open until their tasks end; what they queued is not sent

    async def run(sid: int, request: generation_pb2.GenerateStreamRequest) -> None:
        try:
            async for msg in stream(request):
                out.put_nowait((sid, msg))
        except Exception as exc:  # what GenerateStream's call would have ended with
            code, message = rejection(exc, METHOD, count=False)  # the request's outcome is counted
            out.put_nowait((sid, generation_pb2.StreamError(code=code.value[0], message=message)))

    def started(sid: int, request: generation_pb2.GenerateStreamRequest) -> asyncio.Task[None]:
        task = asyncio.ensure_future(run(sid, request))
        # the end marker even for a task cancelled before it ran: the loop waits for every stream's
        task.add_done_callback(lambda _: out.put_nowait((sid, None)))
        return task

    async def read() -> None:
        """The client's starts and cancels; a malformed one ends the whole call (INVALID_ARGUMENT)."""
        async for r in requests:
            if isinstance(r, _Undecodable):
                raise InvalidRequestError(f"a request could not be parsed ({r.error}); strings must be valid UTF-8")
            which = r.WhichOneof("action")
            if which == "start":
                if r.id in tasks:
                    raise InvalidRequestError(f"stream {r.id} is already open on this call")
                tasks[r.id] = started(r.id, r.start)
            elif which == "cancel":
                if r.id in tasks:  # else it ended already: nothing to stop
                    tasks[r.id].cancel()
                    cancelled.add(r.id)
            else:
                raise InvalidRequestError(f"stream {r.id}: a GenerateStreamsRequest needs start or cancel")

    reader = asyncio.ensure_future(read())
    try:
        while True:
            if reader.done():
                reader.result()  # a malformed request, or the client's side broke: the call ends
                if not tasks and out.empty():
                    return  # half-closed, and every stream ended
                items = [await out.get()]
            else:
                waiter = asyncio.ensure_future(out.get())
                await asyncio.wait({waiter, reader}, timeout=IDLE_CHECK_SECONDS, return_when=asyncio.FIRST_COMPLETED)
                if not waiter.done():
                    waiter.cancel()
                    if not tasks and stopping():
                        return
                    continue
                items = [waiter.result()]
            await asyncio.sleep(0)  # the step's other streams, woken with this one, queue theirs
            while not out.empty() and len(items) < MAX_PIECES:
                items.append(out.get_nowait())
            pieces: list[generation_pb2.StreamPiece] = []
            size = 0
            for sid, item in items:
                if item is None:
                    tasks.pop(sid, None)
                    cancelled.discard(sid)
                    continue
                if sid in cancelled:
                    continue
                if isinstance(item, generation_pb2.StreamError):
                    piece = generation_pb2.StreamPiece(id=sid, error=item)
                else:
                    piece = generation_pb2.StreamPiece(id=sid, message=item)
                n = piece.ByteSize()
                if pieces and size + n > MAX_RESPONSE_BYTES:
                    yield generation_pb2.GenerateStreamsResponse(pieces=pieces)
                    pieces, size = [], 0
                pieces.append(piece)
                size += n
            if pieces:
                yield generation_pb2.GenerateStreamsResponse(pieces=pieces)
            if not tasks and stopping():
                return  # draining, and nothing open: the front end's idle call must not hold it up
    finally:
        reader.cancel()
        for t in tasks.values():
            t.cancel()
