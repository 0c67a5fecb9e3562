"""The public Generation API: protobuf in, domain objects to the scheduler, protobuf out, on grpc.aio.

A waiting call holds no thread: checking and tokenising a request runs in a small worker pool, off
the event loop (and off the scheduler's thread); the scheduler's thread completes a call through
the ticket's done callback, which schedules the waiter's wake-up on the loop
(`call_soon_threadsafe`), and feeds a stream through an asyncio.Queue the same way. A call that the
client cancels, or whose deadline passes, has its handler task cancelled, and that cancels the
ticket. So `--max-queue`, not a thread count, bounds the work that waits (docs/reliability.md).

A `messages` prompt is rendered by the model's chat template in a renderer process
(moe_lightning.template_renderer), bounded in time and output. Each render holds one of a few render
slots, taken on the loop before the render gets a worker thread and given back when it ends, so
renders, however slow, never hold more than that many of the workers and text prompts keep theirs;
the checks and tokenisation around a render hold no slot (a call's rows run in order, in jobs split
at each render: _submit_async).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc
import structlog

from moe_lightning import __version__
from moe_lightning.api.common.v1 import common_pb2
from moe_lightning.api.generation.v1 import generation_pb2, generation_pb2_grpc
from moe_lightning.chat_template import ChatTemplate, ChatTemplateError, rendered_ids
from moe_lightning.request import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, GenerationRequest, InvalidRequestError
from moe_lightning.sampling import TokenLogprobs
from moe_lightning.service.convert import logprobs_to_pb, model_info_to_pb
from moe_lightning.service.errors import NotReadyError, ResourceExhaustedError
from moe_lightning.template_renderer import DEFAULT_TIMEOUT, RENDERERS, TemplateRenderer
from moe_lightning.validation import (
    INPUT_OVERHEAD_BYTES,
    MAX_BATCH_PROMPTS,
    RequestLimits,
    check_batch,
    check_prompt_length,
    check_text_size,
    max_text_bytes,
    prompt_ids,
    validate,
)
from orchestrator.conversation import Conversation, conversation_from_pb
from orchestrator.request_options import grammar_from_input, sampling_from_input
from orchestrator.scheduler import Scheduler
from orchestrator.streams import generate_streams
from orchestrator.ticket import Ticket, TokenCallback

DEFAULT_MAX_NEW_TOKENS = 64
MIN_RECEIVE_BYTES = 4 << 20


def max_receive_bytes(max_prompt_tokens: int) -> int:
    """The public API's receive limit: a BatchGenerate of MAX_BATCH_PROMPTS inputs, each at the longest
    legal prompt (text or token ids: an id takes at most 5 bytes, text 8 a token) and its other fields.
    gRPC has one limit for every method, so one Generate may carry that much; what a single prompt
    can be is checked on arrival, before any of it is copied (to_request)."""
    per_input = max(max_text_bytes(max_prompt_tokens), 5 * max_prompt_tokens) + INPUT_OVERHEAD_BYTES
    return max(MIN_RECEIVE_BYTES, MAX_BATCH_PROMPTS * per_input)


FINISH_TO_PB = {
    FINISH_EOS: generation_pb2.FINISH_REASON_EOS,
    FINISH_STOP: generation_pb2.FINISH_REASON_STOP,
    FINISH_LENGTH: generation_pb2.FINISH_REASON_LENGTH,
}


Item = tuple[list[int], list[TokenLogprobs], str]
_T = TypeVar("_T")


def _threadsafe(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop closed (the process is ending): nobody waits any more
        pass


async def _queued(queue: asyncio.Queue[Item | None]) -> tuple[list[Item], bool]:
    """Every item queued now (waiting for the first), and whether the end (None) came: a reader
    slower than the decode gets several steps' tokens in one message, so a stream's cost per
    message is paid less often exactly when the reader is behind (docs/openai.md "Overhead")."""
    items: list[Item] = []
    item = await queue.get()
    while item is not None:
        items.append(item)
        if queue.empty():
            return items, False
        item = queue.get_nowait()
    return items, True


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, device: str = "", workers: int = 8, stream_interval: int = 1) -> None:
        self.scheduler: Scheduler | None = None
        self.stream_interval = stream_interval  # GenerateStream's tokens per message unless a request says
        self.device = device
        self.model_path = ""
        self.kv_cache_dtype = ""  # of the KV cache attention reads (set once the policy placed it)
        self.chat_template: ChatTemplate | None = None  # renders a `messages` prompt (docs/openai.md)
        # its renderer processes (server.py starts them); without, chats render in process, bounded in size only
        self.renderer: TemplateRenderer | None = None
        # how outputs carry tool calls and reasoning ("": not at all), for the gateway (output_formats.py)
        self.tool_call_format = ""
        self.reasoning_format = ""
        # checks and tokenisation: a bounded prompt (check_text_size) takes milliseconds
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="orchestrator-tokenize")
        self._workers = max(1, workers)
        self._render_slots: asyncio.Semaphore | None = None  # made on the loop, at the first chat

    def _sched(self) -> Scheduler:
        if self.scheduler is None:
            raise NotReadyError("the server is still starting; retry when health is SERVING")
        return self.scheduler

    # ---- conversion ----------------------------------------------------------------------------
    def to_request(
        self,
        m: generation_pb2.GenerationInput,
        limits: RequestLimits,
        cancel: threading.Event | None = None,
        rendered: str | None = None,
    ) -> GenerationRequest:
        """The domain request, checked against every limit: the scheduler trusts what it is given.
        `cancel` set: the client left, and a render in progress for it stops. `rendered`: a `messages`
        prompt's text, rendered already (as _submit_async does, under a render slot); without it the
        conversation is rendered here."""
        which = m.WhichOneof("prompt")
        if which == "text":
            check_text_size(m.text, limits.max_prompt_tokens)
        elif which == "token_ids":
            check_prompt_length(len(m.token_ids.ids), limits)  # O(1): before the ids become a list
        if which == "messages":
            prompt = (
                self._chat_prompt(m.messages, limits, cancel) if rendered is None else self._chat_ids(rendered, limits)
            )
        else:
            prompt = prompt_ids(
                m.text if which == "text" else None,
                m.token_ids.ids if which == "token_ids" else None,
                self._sched().tokenizer,
            )
        request = GenerationRequest(
            prompt_ids=prompt,
            max_new_tokens=m.max_new_tokens if m.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS,
            sampling=sampling_from_input(m),
            stop=tuple(m.stop),
            ignore_eos=m.ignore_eos,
            request_id=m.request_id or uuid.uuid4().hex[:16],
            grammar=grammar_from_input(m),
            echo=m.echo,
            skip_special_tokens=m.skip_special_tokens if m.HasField("skip_special_tokens") else True,
        )
        validate(request, limits)
        if request.grammar is not None:
            self._sched().grammars.check(request.grammar)  # compiled once per grammar: cached
        return request

    def _chat_prompt(
        self, m: generation_pb2.ChatMessages, limits: RequestLimits, cancel: threading.Event | None = None
    ) -> list[int]:
        """A conversation through the model's chat template, the one rendering both APIs share: checked
        and read (_conversation), rendered (_render), tokenised (_chat_ids). _submit_async runs the
        three apart, the render alone under a render slot."""
        return self._chat_ids(self._render(self._conversation(m, limits), limits, cancel), limits)

    def _conversation(self, m: generation_pb2.ChatMessages, limits: RequestLimits) -> Conversation:
        """The conversation to render, refused first if no prompt could hold it."""
        if self.chat_template is None or self._sched().tokenizer is None:
            raise InvalidRequestError(
                "this model has no chat template (none in its tokenizer_config.json, no --chat-template on the "
                "server): send a text prompt instead of messages"
            )
        return conversation_from_pb(m, limits.max_prompt_tokens)

    def _render(self, conv: Conversation, limits: RequestLimits, cancel: threading.Event | None = None) -> str:
        """The template's text: in a renderer process (bounded in time, output and memory), or, without
        one (in-process tests), here, bounded in output only."""
        assert self.chat_template is not None  # _conversation refuses a chat without one
        extra = {"tools": conv.tools, "template_kwargs": conv.template_kwargs}
        try:
            if self.renderer is not None:
                return self.renderer.render(conv.messages, cancel=cancel, **extra)
            max_bytes = None if limits.max_prompt_tokens is None else max_text_bytes(limits.max_prompt_tokens)
            return self.chat_template.render(conv.messages, max_bytes=max_bytes, **extra)
        except ChatTemplateError as exc:
            raise InvalidRequestError(str(exc)) from None

    def _chat_ids(self, text: str, limits: RequestLimits) -> list[int]:
        # a template can make a long text of a short chat: bounded as any text before it is tokenized
        check_text_size(text, limits.max_prompt_tokens)
        tokenizer = self._sched().tokenizer
        assert tokenizer is not None  # _conversation refuses a chat without one
        return rendered_ids(tokenizer, text)  # ChatTemplate.prompt_ids' encoding, tested against transformers

    async def _render_slot(self) -> asyncio.Semaphore:
        """One of the few render slots (as many as renderer processes, at most half the workers, at least
        one), waited for no longer than a render may take: a render that cannot have one then is
        refused as busy."""
        renderer = self.renderer
        timeout = renderer.timeout if renderer is not None else DEFAULT_TIMEOUT
        if self._render_slots is None:
            processes = renderer.processes if renderer is not None else RENDERERS
            self._render_slots = asyncio.Semaphore(min(processes, max(1, self._workers // 2)))
        slots = self._render_slots
        try:
            async with asyncio.timeout(timeout):
                await slots.acquire()
        except TimeoutError:
            raise ResourceExhaustedError(
                f"every chat template renderer has been busy for {timeout:g} s (renders of up to {timeout:g} s "
                "each): retry shortly"
            ) from None
        return slots

    def logprobs_pb(self, logprobs: list[TokenLogprobs]) -> list[common_pb2.TokenLogprobs]:
        """With each token's text when there is a tokenizer (the OpenAI API shows tokens as text)."""
        out = [logprobs_to_pb(lp) for lp in logprobs]
        tokenizer = self.scheduler.tokenizer if self.scheduler is not None else None
        if tokenizer is not None:
            for m in out:
                m.token = tokenizer.decode([m.token_id])
                m.top_tokens.extend(tokenizer.decode([t]) for t in m.top_token_ids)
        return out

    def to_output(self, t: Ticket) -> generation_pb2.GenerationOutput:
        r = t.wait(0)
        out = generation_pb2.GenerationOutput(
            request_id=t.request.request_id,
            text=r.text or "",
            token_ids=r.token_ids,
            finish_reason=FINISH_TO_PB.get(r.finish_reason, generation_pb2.FINISH_REASON_UNSPECIFIED),
            usage=generation_pb2.Usage(prompt_tokens=r.prompt_tokens, completion_tokens=r.completion_tokens),
            timings=generation_pb2.Timings(
                queue_ns=int((t.admitted - t.arrival) * 1e9),
                time_to_first_token_ns=int((t.first_token - t.arrival) * 1e9),
                total_ns=int((t.finished - t.arrival) * 1e9),
            ),
            logprobs=self.logprobs_pb(r.logprobs),
            preemptions=r.preemptions,
            prompt_logprobs=self.logprobs_pb(r.prompt_logprobs),
        )
        tokenizer = self.scheduler.tokenizer if self.scheduler is not None else None
        if t.request.echo and tokenizer is not None:  # (validation refuses echo without one)
            ids = t.request.prompt_ids
            out.prompt_text = tokenizer.decode(ids)
            out.prompt_token_ids.extend(ids)
            out.prompt_tokens.extend(tokenizer.decode([i]) for i in ids)
        return out

    # ---- RPCs ----------------------------------------------------------------------------------
    async def _submit_async(
        self,
        inputs: list[generation_pb2.GenerationInput],
        on_tokens: TokenCallback | None = None,
        batch: bool = False,
    ) -> tuple[Scheduler, list[Ticket], list[asyncio.Future[None]]]:
        """Checks, tokenises and queues `inputs`, in order, on worker threads: all or none are queued.
        The rows run as jobs split at each chat's render, which alone holds a render slot (its own job):
        a chat among many text prompts holds none while they are tokenised, and a batch of chats takes a
        slot per render, so other calls' renders interleave with its own."""
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future[None]] = [loop.create_future() for _ in inputs]
        sched = self._sched()
        limits = sched.limits()
        cancel = threading.Event()  # set when the client leaves: its render, if any, stops
        requests: list[GenerationRequest] = []
        rendered: dict[int, str] = {}  # a chat's text, from its render until its row is converted

        def convert(start: int, end: int) -> Conversation | None:
            """Rows start..end-1 become requests (a chat among them was rendered); row `end`, when it
            is a chat, is checked and read for its render, which comes next."""
            i = start
            try:
                for i in range(start, end):
                    requests.append(self.to_request(inputs[i], limits, cancel, rendered.pop(i, None)))
                i = end
                return self._conversation(inputs[end].messages, limits) if end < len(inputs) else None
            except (InvalidRequestError, ResourceExhaustedError) as exc:
                if not batch:
                    raise
                raise type(exc)(f"input {i}: {exc}") from None  # the index names the bad row

        def finish(start: int) -> list[Ticket]:  # the rows after the last render; then all are queued
            convert(start, len(inputs))  # validate all before queueing any
            if batch:
                check_batch(requests, limits)  # its one response message must be sendable
            tickets: list[Ticket] = []
            try:
                for r, fut in zip(requests, futs, strict=True):
                    with structlog.contextvars.bound_contextvars(request_id=r.request_id):
                        ticket = sched.submit(r, on_tokens)
                    tickets.append(ticket)
                    ticket.add_done_callback(lambda f=fut: _threadsafe(loop, _resolve, f))
            except Exception:  # the queue filled up, or the server is stopping: none of the batch runs
                for t in tickets:
                    sched.cancel(t)
                raise
            return tickets

        start = 0
        for i, m in enumerate(inputs):
            if m.WhichOneof("prompt") != "messages":
                continue
            conversation = await self._in_pool(functools.partial(convert, start, i), cancel)
            assert conversation is not None
            try:
                rendered[i] = await self._render_in_slot(conversation, limits, cancel)
            except InvalidRequestError as exc:  # the template's refusal, or a bound it passed
                if not batch:
                    raise
                raise InvalidRequestError(f"input {i}: {exc}") from None
            start = i

        def drop(j: asyncio.Future[list[Ticket]]) -> None:  # the client left: what was queued for it goes
            if not j.cancelled() and j.exception() is None:
                for t in j.result():
                    sched.cancel(t)

        return sched, await self._in_pool(functools.partial(finish, start), cancel, drop), futs

    async def _in_pool(
        self,
        fn: Callable[[], _T],
        cancel: threading.Event,
        on_left: Callable[[asyncio.Future[_T]], None] | None = None,
    ) -> _T:
        """`fn` on a worker thread. A client that leaves meanwhile (CancelledError) sets `cancel` (a render
        stops) but leaves the job to end on its thread; `on_left` then runs on its end."""
        job = asyncio.get_running_loop().run_in_executor(self._pool, fn)
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            cancel.set()
            if on_left is not None:
                job.add_done_callback(on_left)
            raise

    async def _render_in_slot(self, conversation: Conversation, limits: RequestLimits, cancel: threading.Event) -> str:
        """The conversation's text, rendered on a worker thread under a render slot, held until the
        render ends, even when the client leaves first (its thread is busy until the render stops)."""
        slots = await self._render_slot()
        try:
            job = asyncio.get_running_loop().run_in_executor(self._pool, self._render, conversation, limits, cancel)
        except BaseException:
            slots.release()
            raise
        job.add_done_callback(lambda _: slots.release())
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            cancel.set()
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

        def chunk(items: list[Item]) -> generation_pb2.GenerateStreamResponse:
            return generation_pb2.GenerateStreamResponse(
                token_ids=[t for tokens, _, _ in items for t in tokens],
                text="".join(text for _, _, text in items),
                logprobs=self.logprobs_pb([lp for _, logprobs, _ in items for lp in logprobs]),
            )

        interval = request.stream_interval or self.stream_interval
        try:
            while True:
                items, ended = await _queued(queue)
                count = sum(len(tokens) for tokens, _, _ in items)
                while not ended and count < interval:
                    more, ended = await _queued(queue)
                    items += more
                    count += sum(len(tokens) for tokens, _, _ in more)
                if not ended and ticket.done.is_set():  # the rest is already queued: it goes with the output
                    while (more := await queue.get()) is not None:
                        items.append(more)
                    ended = True
                msg = chunk(items)
                if not ended:
                    yield msg
                    continue
                if ticket.error is None:  # the last tokens' delta completes the text
                    msg.output.CopyFrom(self.to_output(ticket))
                    yield msg
                    return
                if items:
                    yield msg
                break
        finally:
            if not ticket.done.is_set():  # the client went away (or its deadline passed)
                sched.cancel(ticket)
        yield generation_pb2.GenerateStreamResponse(output=self.to_output(ticket))  # raises the request's error

    async def GenerateStreams(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[generation_pb2.GenerateStreamsRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[generation_pb2.GenerateStreamsResponse]:
        def stopping() -> bool:
            return self.scheduler is not None and self.scheduler.stopping

        async for response in generate_streams(request_iterator, lambda r: self.GenerateStream(r, context), stopping):
            yield response

    async def GetModelInfo(  # type: ignore[override]
        self, request: generation_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GetModelInfoResponse:
        return generation_pb2.GetModelInfoResponse(model=model_info_to_pb(self._sched().spec, self.model_path))

    async def GetServerMetadata(  # type: ignore[override]
        self, request: generation_pb2.GetServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GetServerMetadataResponse:
        s = self._sched()
        return generation_pb2.GetServerMetadataResponse(
            version=__version__,
            device=self.device,
            max_batch_size=s.config.max_batch_size,
            kv_cache_tokens=s.batcher.kv.tokens,
            max_queue_size=s.config.max_queue,
            max_batch_prompts=MAX_BATCH_PROMPTS,
            micro_batch_size=s.config.micro_batch_size,
            kv_cache_dtype=self.kv_cache_dtype,
            tool_call_format=self.tool_call_format,
            reasoning_format=self.reasoning_format,
        )
