"""The public Generation API: protobuf in, domain objects to the scheduler, protobuf out."""

from __future__ import annotations

import queue
import uuid
from collections.abc import Iterator

import grpc
import structlog

from moe_lightning import __version__
from moe_lightning.api.generation.v1 import generation_pb2, generation_pb2_grpc
from moe_lightning.request import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, GenerationRequest, InvalidRequestError
from moe_lightning.sampling import TokenLogprobs
from moe_lightning.service.convert import logprobs_to_pb, model_info_to_pb
from moe_lightning.service.errors import NotReadyError, ResourceExhaustedError
from moe_lightning.validation import RequestLimits, prompt_ids, sampling_params, validate
from orchestrator.scheduler import Scheduler, Ticket

DEFAULT_MAX_NEW_TOKENS = 64
MAX_BATCH_PROMPTS = 1024
# Text is refused unread past --max-prefill-tokens x this many UTF-8 bytes: no tokenizer turns more text
# into that few tokens in practice (English and code average about 4 bytes a token, CJK 3 or less; the
# longest whitespace and punctuation runs of common vocabularies are 16), and encoding text costs time
# that grows faster than its length while holding the GIL (8 MiB took 21 s), so it must not start.
MAX_TEXT_BYTES_PER_TOKEN = 8
# what one input carries besides its prompt: request_id, stop strings, sampling fields
INPUT_OVERHEAD_BYTES = 4096
MIN_RECEIVE_BYTES = 4 << 20


def max_text_bytes(max_prompt_tokens: int) -> int:
    """The longest prompt text (UTF-8 bytes) a server accepting `max_prompt_tokens` tokens reads."""
    return max_prompt_tokens * MAX_TEXT_BYTES_PER_TOKEN


def max_receive_bytes(max_prompt_tokens: int) -> int:
    """The public API's receive limit: a BatchGenerate of MAX_BATCH_PROMPTS inputs, each at the longest
    legal prompt (text or token ids: an id takes at most 5 bytes, text 8 a token) and its other fields."""
    per_input = max(max_text_bytes(max_prompt_tokens), 5 * max_prompt_tokens) + INPUT_OVERHEAD_BYTES
    return max(MIN_RECEIVE_BYTES, MAX_BATCH_PROMPTS * per_input)


def check_text_size(text: str, max_prompt_tokens: int | None) -> None:
    """Refuses text no legal prompt could be, before anything reads it (len() is O(1); a character is at
    least one byte, so only text under the bound in characters is measured in bytes)."""
    if max_prompt_tokens is None:
        return
    limit = max_text_bytes(max_prompt_tokens)
    if len(text) > limit or len(text.encode("utf-8", "surrogatepass")) > limit:
        raise InvalidRequestError(
            f"prompt text is longer than any accepted prompt: at most {limit} bytes of UTF-8 "
            f"({max_prompt_tokens} tokens, --max-prefill-tokens, x {MAX_TEXT_BYTES_PER_TOKEN} bytes a token); "
            "send a shorter prompt"
        )


FINISH_TO_PB = {
    FINISH_EOS: generation_pb2.FINISH_REASON_EOS,
    FINISH_STOP: generation_pb2.FINISH_REASON_STOP,
    FINISH_LENGTH: generation_pb2.FINISH_REASON_LENGTH,
}


class StreamSink:
    """A streaming waiter's queue, fed by the scheduler's thread once per generated token with the token
    ids, their log-probabilities (when the request asked for them, else []) and the text the tokens
    complete for the stream (the request's OutputText delta: "" while text is held back)."""

    def __init__(self) -> None:
        self.queue: queue.Queue[tuple[list[int], list[TokenLogprobs], str]] = queue.Queue()

    def __call__(self, tokens: list[int], logprobs: list[TokenLogprobs], text: str) -> None:
        self.queue.put((tokens, logprobs, text))


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, device: str = "") -> None:
        self.scheduler: Scheduler | None = None
        self.device = device
        self.model_path = ""
        self.kv_cache_dtype = ""  # of the KV cache attention reads (set once the policy placed it)

    def _sched(self) -> Scheduler:
        if self.scheduler is None:
            raise NotReadyError("the server is still starting; retry when health is SERVING")
        return self.scheduler

    # ---- conversion ----------------------------------------------------------------------------
    def to_request(self, m: generation_pb2.GenerationInput, limits: RequestLimits) -> GenerationRequest:
        """The domain request, checked against every limit: the scheduler trusts what it is given."""
        which = m.WhichOneof("prompt")
        if which == "text":
            check_text_size(m.text, limits.max_prompt_tokens)
        prompt = prompt_ids(
            m.text if which == "text" else None,
            m.token_ids.ids if which == "token_ids" else None,
            self._sched().tokenizer,
        )
        sampling = sampling_params(
            m.temperature if m.HasField("temperature") else 0.0,
            m.top_k if m.HasField("top_k") else 0,
            m.top_p if m.HasField("top_p") else 1.0,
            m.seed if m.HasField("seed") else None,
            m.logprobs,
        )
        request = GenerationRequest(
            prompt_ids=prompt,
            max_new_tokens=m.max_new_tokens if m.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS,
            sampling=sampling,
            stop=tuple(m.stop),
            ignore_eos=m.ignore_eos,
            request_id=m.request_id or uuid.uuid4().hex[:16],
        )
        validate(request, limits)
        return request

    @staticmethod
    def to_output(t: Ticket) -> generation_pb2.GenerationOutput:
        r = t.wait(0)
        return generation_pb2.GenerationOutput(
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
            logprobs=[logprobs_to_pb(lp) for lp in r.logprobs],
        )

    def _submit(
        self, m: generation_pb2.GenerationInput, context: grpc.ServicerContext, sink: StreamSink | None = None
    ) -> Ticket:
        sched = self._sched()
        request = self.to_request(m, sched.limits())
        with structlog.contextvars.bound_contextvars(request_id=request.request_id):
            ticket = sched.submit(request, sink)
        context.add_callback(lambda: None if ticket.done.is_set() else sched.cancel(ticket))
        return ticket

    # ---- RPCs ----------------------------------------------------------------------------------
    def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> generation_pb2.GenerateResponse:
        ticket = self._submit(request.input, context)
        ticket.done.wait()
        return generation_pb2.GenerateResponse(output=self.to_output(ticket))

    def GenerateStream(
        self, request: generation_pb2.GenerateStreamRequest, context: grpc.ServicerContext
    ) -> Iterator[generation_pb2.GenerateStreamResponse]:
        sink = StreamSink()
        ticket = self._submit(request.input, context, sink)

        def chunk(tokens: list[int], logprobs: list[TokenLogprobs], text: str) -> generation_pb2.GenerateStreamResponse:
            return generation_pb2.GenerateStreamResponse(
                token_ids=tokens, text=text, logprobs=[logprobs_to_pb(lp) for lp in logprobs]
            )

        while True:
            try:
                msg = chunk(*sink.queue.get(timeout=0.05))
            except queue.Empty:
                if ticket.done.is_set() and sink.queue.empty():
                    break
                continue
            # the scheduler feeds the sink before it marks the ticket done, so an empty queue of a done
            # ticket means these were the last tokens (their delta completes the text): send them with
            # the final output
            if ticket.done.is_set() and ticket.error is None and sink.queue.empty():
                msg.output.CopyFrom(self.to_output(ticket))
                yield msg
                return
            yield msg
        yield generation_pb2.GenerateStreamResponse(output=self.to_output(ticket))  # raises the request's error

    def BatchGenerate(
        self, request: generation_pb2.BatchGenerateRequest, context: grpc.ServicerContext
    ) -> generation_pb2.BatchGenerateResponse:
        n = len(request.inputs)
        if not 0 < n <= MAX_BATCH_PROMPTS:
            raise InvalidRequestError(f"BatchGenerate takes 1 to {MAX_BATCH_PROMPTS} inputs, got {n}")
        sched = self._sched()
        limits = sched.limits()
        requests = []
        for i, m in enumerate(request.inputs):  # validate all before queueing any
            try:
                requests.append(self.to_request(m, limits))
            except (InvalidRequestError, ResourceExhaustedError) as exc:
                # the index lets a client with thousands of rows name the bad one
                raise type(exc)(f"input {i}: {exc}") from None
        tickets: list[Ticket] = []
        try:
            for r in requests:
                tickets.append(sched.submit(r))
        except Exception:  # the queue filled up, or the server is stopping: none of the batch runs
            for t in tickets:
                sched.cancel(t)
            raise
        context.add_callback(lambda: [sched.cancel(t) for t in tickets if not t.done.is_set()])
        for t in tickets:
            t.done.wait()
        return generation_pb2.BatchGenerateResponse(outputs=[self.to_output(t) for t in tickets])

    def GetModelInfo(
        self, request: generation_pb2.GetModelInfoRequest, context: grpc.ServicerContext
    ) -> generation_pb2.GetModelInfoResponse:
        return generation_pb2.GetModelInfoResponse(model=model_info_to_pb(self._sched().spec, self.model_path))

    def GetServerMetadata(
        self, request: generation_pb2.GetServerMetadataRequest, context: grpc.ServicerContext
    ) -> generation_pb2.GetServerMetadataResponse:
        s = self._sched()
        return generation_pb2.GetServerMetadataResponse(
            version=__version__,
            device=self.device,
            max_batch_size=s.config.max_batch_size,
            kv_cache_tokens=s.kv_blocks * s.block_size,
            max_queue_size=s.config.max_queue,
            max_batch_prompts=MAX_BATCH_PROMPTS,
            micro_batch_size=s.config.micro_batch_size,
            kv_cache_dtype=self.kv_cache_dtype,
        )
