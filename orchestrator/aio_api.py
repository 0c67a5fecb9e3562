"""The public Generation API on grpc.aio: a waiting call holds no thread (issue 14, item 5).

Checking and tokenising a request runs in a small worker pool, off the event loop (and off the
scheduler's thread, as before); the scheduler's thread completes a call by scheduling a callback on
the loop (`call_soon_threadsafe`), and feeds a stream through an asyncio.Queue the same way. A call
that the client cancels, or whose deadline passes, has its handler task cancelled: that cancels
the ticket, as `context.add_callback` did for the threaded server.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog

from moe_lightning.api.generation.v1 import generation_pb2
from moe_lightning.request import GenerationRequest, InvalidRequestError
from moe_lightning.sampling import TokenLogprobs
from moe_lightning.service.convert import logprobs_to_pb
from moe_lightning.service.errors import ResourceExhaustedError
from orchestrator.api import MAX_BATCH_PROMPTS, GenerationServicer
from orchestrator.scheduler import Scheduler, Ticket, TokenCallback

Item = tuple[list[int], list[TokenLogprobs], str]


class _NotifyingEvent(threading.Event):
    """A ticket's `done` that also tells the event loop when the scheduler sets it."""

    def __init__(self, notify: Callable[[], None]) -> None:
        super().__init__()
        self._notify = notify

    def set(self) -> None:
        super().set()
        self._notify()


def _submit(
    sched: Scheduler, request: GenerationRequest, on_tokens: TokenCallback | None, notify: Callable[[], None]
) -> Ticket:
    # The scheduler sets `done` only with its lock held, and that lock is re-entrant (submit takes it
    # too): swapping the event while holding it, no completion can fall between submit and the swap.
    with sched._cv:
        ticket = sched.submit(request, on_tokens)
        old, ticket.done = ticket.done, _NotifyingEvent(notify)
        if old.is_set():
            ticket.done.set()
    return ticket


def _threadsafe(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop closed (the process is ending): nobody waits any more
        pass


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class AioGenerationServicer(GenerationServicer):
    """GenerationServicer's conversions and checks, served by coroutines."""

    def __init__(self, device: str = "", workers: int = 8) -> None:
        super().__init__(device)
        # checks and tokenisation: a bounded prompt (orchestrator.api.check_text_size) takes milliseconds
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="orchestrator-tokenize")

    async def _submit_async(
        self,
        inputs: list[generation_pb2.GenerationInput],
        on_tokens: TokenCallback | None = None,
        batch: bool = False,
    ) -> tuple[Scheduler, list[Ticket], list[asyncio.Future[None]]]:
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future[None]] = [loop.create_future() for _ in inputs]
        sched = self._sched()

        def work() -> list[Ticket]:  # a worker thread: validation, tokenisation, queueing
            limits = sched.limits()
            requests = []
            for i, m in enumerate(inputs):  # validate all before queueing any
                try:
                    requests.append(self.to_request(m, limits))
                except (InvalidRequestError, ResourceExhaustedError) as exc:
                    if not batch:
                        raise
                    raise type(exc)(f"input {i}: {exc}") from None  # the index names the bad row
            tickets: list[Ticket] = []
            try:
                for r, fut in zip(requests, futs, strict=True):
                    with structlog.contextvars.bound_contextvars(request_id=r.request_id):
                        tickets.append(_submit(sched, r, on_tokens, lambda f=fut: _threadsafe(loop, _resolve, f)))
            except Exception:  # the queue filled up, or the server is stopping: none of the batch runs
                for t in tickets:
                    sched.cancel(t)
                raise
            return tickets

        job = loop.run_in_executor(self._pool, work)
        try:
            return sched, await asyncio.shield(job), futs
        except asyncio.CancelledError:  # the client left while its request was being checked

            def drop(j: asyncio.Future[list[Ticket]]) -> None:
                if not j.cancelled() and j.exception() is None:
                    for t in j.result():
                        sched.cancel(t)

            job.add_done_callback(drop)
            raise

    @staticmethod
    async def _wait(sched: Scheduler, tickets: list[Ticket], futs: list[asyncio.Future[None]]) -> None:
        try:
            await asyncio.gather(*futs)
        finally:  # cancelled by the client or its deadline (CancelledError): the tickets go too
            for t in tickets:
                if not t.done.is_set():
                    sched.cancel(t)

    async def Generate(  # type: ignore[override]
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GenerateResponse:
        sched, tickets, futs = await self._submit_async([request.input])
        await self._wait(sched, tickets, futs)
        return generation_pb2.GenerateResponse(output=self.to_output(tickets[0]))

    async def BatchGenerate(  # type: ignore[override]
        self, request: generation_pb2.BatchGenerateRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.BatchGenerateResponse:
        n = len(request.inputs)
        if not 0 < n <= MAX_BATCH_PROMPTS:
            raise InvalidRequestError(f"BatchGenerate takes 1 to {MAX_BATCH_PROMPTS} inputs, got {n}")
        sched, tickets, futs = await self._submit_async(list(request.inputs), batch=True)
        await self._wait(sched, tickets, futs)
        return generation_pb2.BatchGenerateResponse(outputs=[self.to_output(t) for t in tickets])

    async def GenerateStream(  # type: ignore[override]
        self, request: generation_pb2.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Item | None] = asyncio.Queue()

        def on_tokens(tokens: list[int], logprobs: list[TokenLogprobs], text: str) -> None:
            _threadsafe(loop, queue.put_nowait, (tokens, logprobs, text))

        sched, tickets, futs = await self._submit_async([request.input], on_tokens)
        ticket = tickets[0]
        # after every token: the scheduler feeds the sink before it sets done, and the loop runs
        # call_soon_threadsafe callbacks in order, so None is the last item
        futs[0].add_done_callback(lambda _: queue.put_nowait(None))

        def chunk(tokens: list[int], logprobs: list[TokenLogprobs], text: str) -> generation_pb2.GenerateStreamResponse:
            return generation_pb2.GenerateStreamResponse(
                token_ids=tokens, text=text, logprobs=[logprobs_to_pb(lp) for lp in logprobs]
            )

        try:
            while (item := await queue.get()) is not None:
                if not ticket.done.is_set():
                    yield chunk(*item)
                    continue
                # done: the rest is already queued; the last tokens go with the final output (their
                # delta completes the text)
                rest = [item]
                while (more := await queue.get()) is not None:
                    rest.append(more)
                msgs = [chunk(*i) for i in rest]
                for msg in msgs[:-1]:
                    yield msg
                if ticket.error is None:
                    msgs[-1].output.CopyFrom(self.to_output(ticket))
                    yield msgs[-1]
                    return
                yield msgs[-1]
                break
        finally:
            if not ticket.done.is_set():  # the client went away (or its deadline passed)
                sched.cancel(ticket)
        yield generation_pb2.GenerateStreamResponse(output=self.to_output(ticket))  # raises the request's error

    async def GetModelInfo(  # type: ignore[override]
        self, request: generation_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GetModelInfoResponse:
        return GenerationServicer.GetModelInfo(self, request, context)  # type: ignore[arg-type]

    async def GetServerMetadata(  # type: ignore[override]
        self, request: generation_pb2.GetServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GetServerMetadataResponse:
        return GenerationServicer.GetServerMetadata(self, request, context)  # type: ignore[arg-type]
