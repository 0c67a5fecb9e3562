"""A small Python client for the public Generation API."""

from __future__ import annotations

import queue
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from moe_lightning.api.generation.v1 import generation_pb2, generation_pb2_grpc
from moe_lightning.service.auth import is_local_target
from moe_lightning.service.upstream import CHANNEL_OPTIONS

FINISH_NAMES = {
    generation_pb2.FINISH_REASON_EOS: "eos",
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
}


@dataclass(slots=True)
class Prompt:
    """One generation input; give `text`, `token_ids` or chat `messages` ({"role", "content"} each,
    rendered by the model's chat template on the server)."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    request_id: str = ""
    logprobs: int = 0  # top log-probabilities per generated token (0..20)
    # the sampling controls (docs/api.md): 0 / None is none
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: int | None = None  # the prompt's log-probabilities, with the top this-many (0..20)
    echo: bool = False  # the prompt's text back in Completion.prompt_text
    # structured output: (kind, source), kind one of json_object, json_schema, regex, choice, tool_calls
    grammar: tuple[str, str] | None = None

    def to_pb(self) -> generation_pb2.GenerationInput:
        m = generation_pb2.GenerationInput(
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            request_id=self.request_id,
            logprobs=self.logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids,
            echo=self.echo,
        )
        if self.grammar is not None:
            kind, source = self.grammar
            m.grammar.kind = generation_pb2.GrammarKind.Value(f"GRAMMAR_KIND_{kind.upper()}")
            m.grammar.source = source
        if self.token_ids is not None:
            m.token_ids.ids.extend(self.token_ids)
        elif self.messages is not None:
            m.messages.messages.extend(generation_pb2.ChatMessage(**msg) for msg in self.messages)
        elif self.text is not None:
            m.text = self.text
        for name in (
            "max_new_tokens",
            "temperature",
            "top_k",
            "top_p",
            "seed",
            "repetition_penalty",
            "prompt_logprobs",
        ):
            value = getattr(self, name)
            if value is not None:
                setattr(m, name, value)
        return m


@dataclass(slots=True)
class StreamChunk:
    """A streamed piece: the new tokens, the text they complete (held back near a possible stop
    string, so the pieces add up to the final text) and, when asked, their log-probabilities."""

    token_ids: list[int]
    text: str
    logprobs: list[dict[str, Any]] = field(default_factory=list)


def _logprobs(entries: Any) -> list[dict[str, Any]]:
    return [
        {
            "token_id": t.token_id,
            "logprob": t.logprob,
            "top_token_ids": list(t.top_token_ids),
            "top_logprobs": list(t.top_logprobs),
        }
        for t in entries
    ]


@dataclass(slots=True)
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    queue_seconds: float
    time_to_first_token_seconds: float
    total_seconds: float
    # per generated token, when asked: {"token_id", "logprob", "top_token_ids", "top_logprobs"}
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    preemptions: int = 0  # times the server preempted it (docs/kv-cache.md); the output is the same
    # with prompt_logprobs: per prompt token from the second on, as `logprobs`
    prompt_logprobs: list[dict[str, Any]] = field(default_factory=list)
    prompt_text: str = ""  # with echo

    @classmethod
    def from_pb(cls, m: generation_pb2.GenerationOutput) -> Completion:
        return cls(
            m.request_id,
            m.text,
            list(m.token_ids),
            FINISH_NAMES.get(m.finish_reason, "unspecified"),
            m.usage.prompt_tokens,
            m.usage.completion_tokens,
            m.timings.queue_ns / 1e9,
            m.timings.time_to_first_token_ns / 1e9,
            m.timings.total_ns / 1e9,
            _logprobs(m.logprobs),
            m.preemptions,
            _logprobs(m.prompt_logprobs),
            m.prompt_text,
        )

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]
        for name in ("logprobs", "prompt_logprobs", "prompt_text"):
            if not out[name]:
                del out[name]  # keeps job outputs' columns as they were when nobody asked
        return out


class BatchError(RuntimeError):
    """A BatchGenerate call of a batch helper failed. `rows`: the input indices of its chunk (none of
    them has a result); `row`: the one the server named as invalid, when it did; `code`: gRPC's status."""

    def __init__(self, rows: list[int], code: grpc.StatusCode, details: str) -> None:
        m = re.match(r"input (\d+): ", details)
        self.rows, self.code, self.details = rows, code, details
        self.row = rows[int(m[1])] if m and int(m[1]) < len(rows) else None
        where = f"row {self.row} (chunk of rows {rows[0]}-{rows[-1]})" if self.row is not None else None
        super().__init__(f"{where or f'rows {rows[0]}-{rows[-1]}'} failed: {code.name}: {details}")


@dataclass(frozen=True, slots=True)
class InFlight:
    """How many prompts a batch helper keeps in flight, and why (`describe()` says it in words)."""

    chunk_size: int  # prompts per BatchGenerate call
    chunks: int  # BatchGenerate calls in flight
    planned_batch: int  # the server's max_batch_size when this was decided
    micro_batch_size: int  # the server's micro-batch size (0: one micro-batch)
    max_queue: int  # requests the server lets wait (0: unknown)
    bound: str  # "planned batch", "queue" or "given"

    @property
    def prompts(self) -> int:
        return self.chunk_size * self.chunks

    def describe(self) -> str:
        plan = f"planned batch {self.planned_batch}"
        if self.micro_batch_size:
            plan += f" ({-(-self.planned_batch // self.micro_batch_size)} micro-batches x {self.micro_batch_size})"
        why = {
            "planned batch": f"the server's {plan}, plus one chunk so its queue never runs dry",
            "queue": f"the server's {plan}, bounded by its queue of {self.max_queue}",
            "given": f"as asked; the server's {plan}",
        }[self.bound]
        return (
            f"keeping up to {self.prompts} prompts in flight "
            f"({self.chunks} BatchGenerate calls of {self.chunk_size}): {why}"
        )


def plan_in_flight(meta: generation_pb2.GetServerMetadataResponse, chunk_size: int, in_flight: int = 0) -> InFlight:
    """Enough chunks to cover the server's planned batch plus one (while the slowest row of a chunk
    finishes, the next chunk is already queued), never more than its queue admits; `in_flight` > 0
    wins. A chunk is at most what one BatchGenerate (and the queue) takes."""
    chunk = max(1, chunk_size)
    for limit in (meta.max_batch_prompts, meta.max_queue_size):
        if limit:
            chunk = min(chunk, limit)
    batch, mu, cap = meta.max_batch_size, meta.micro_batch_size, meta.max_queue_size
    if in_flight > 0:
        return InFlight(chunk, in_flight, batch, mu, cap, "given")
    chunks = -(-batch // chunk) + 1
    if cap and chunks * chunk > cap:
        return InFlight(chunk, max(1, cap // chunk), batch, mu, cap, "queue")
    return InFlight(chunk, chunks, batch, mu, cap, "planned batch")


class InsecureTokenError(ValueError):
    """A bearer token would travel in plaintext beyond this machine."""


class GenerationClient:
    # how often a batch helper re-reads the planned batch, which changes when the server re-plans
    REPLAN_CHECK_SECONDS = 1.0

    def __init__(
        self,
        address: str,
        timeout: float | None = None,
        tls_ca: Path | None = None,
        token: str | None = None,
        allow_insecure_token: bool = False,
    ) -> None:
        """`tls_ca`: PEM root certificate(s) to verify a TLS server with (None: plaintext);
        `token`: sent as 'authorization: Bearer <token>' on every call. A token without TLS to an address
        beyond this machine (not loopback, not a unix socket) is refused, since anyone on the path could
        read it, unless `allow_insecure_token` says the network is trusted."""
        if token and tls_ca is None and not allow_insecure_token and not is_local_target(address):
            raise InsecureTokenError(
                f"refusing to send the bearer token in plaintext to {address}: give the server's CA (tls_ca, "
                "--tls-ca) to use TLS, or allow_insecure_token=True (--allow-insecure-token) on a network you trust"
            )
        if tls_ca is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
            self.channel = grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.timeout = timeout

    def generate(self, prompt: Prompt) -> Completion:
        resp = self.stub.Generate(
            generation_pb2.GenerateRequest(input=prompt.to_pb()), timeout=self.timeout, metadata=self._metadata
        )
        return Completion.from_pb(resp.output)

    def stream(self, prompt: Prompt, stream_interval: int = 0) -> Iterator[StreamChunk | Completion]:
        """Yields a StreamChunk per message as tokens come (a step's, or at least `stream_interval`
        tokens; 0: the server's --stream-interval), then the Completion."""
        request = generation_pb2.GenerateStreamRequest(input=prompt.to_pb(), stream_interval=stream_interval)
        for msg in self.stub.GenerateStream(request, timeout=self.timeout, metadata=self._metadata):
            if msg.token_ids or msg.text:
                yield StreamChunk(list(msg.token_ids), msg.text, _logprobs(msg.logprobs))
            if msg.HasField("output"):
                yield Completion.from_pb(msg.output)

    def batch_generate(self, prompts: Sequence[Prompt]) -> list[Completion]:
        resp = self.stub.BatchGenerate(
            generation_pb2.BatchGenerateRequest(inputs=[p.to_pb() for p in prompts]),
            timeout=self.timeout,
            metadata=self._metadata,
        )
        return [Completion.from_pb(o) for o in resp.outputs]

    def batch_as_completed(
        self,
        prompts: Sequence[Prompt],
        chunk_size: int = 64,
        in_flight: int = 0,
        on_plan: Callable[[InFlight], None] | None = None,
    ) -> Iterator[tuple[int, Completion]]:
        """Any number of prompts through BatchGenerate calls of `chunk_size`, keeping enough in flight
        to fill the server's planned batch (`in_flight` > 0: that many calls); yields (input index,
        Completion) as each call finishes, in completion order. `on_plan` hears the in-flight plan
        at the start and whenever a re-plan changes it. A failed call raises BatchError naming its
        rows; the calls still in flight are cancelled (so are they when the iterator is closed)."""
        plan = plan_in_flight(self.server_metadata(), chunk_size, in_flight)
        if on_plan is not None:
            on_plan(plan)
        n, size = len(prompts), plan.chunk_size
        chunks = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
        finished: queue.SimpleQueue[int] = queue.SimpleQueue()
        pending: dict[int, grpc.Future] = {}
        sent, checked = 0, time.monotonic()
        try:
            while sent < len(chunks) or pending:
                while sent < len(chunks) and len(pending) < plan.chunks:
                    req = generation_pb2.BatchGenerateRequest(inputs=[prompts[i].to_pb() for i in chunks[sent]])
                    fut = self.stub.BatchGenerate.future(req, timeout=self.timeout, metadata=self._metadata)
                    pending[sent] = fut
                    fut.add_done_callback(lambda _f, k=sent: finished.put(k))
                    sent += 1
                k = finished.get()
                try:
                    outputs = pending.pop(k).result().outputs
                except grpc.RpcError as exc:
                    raise BatchError(chunks[k], exc.code(), exc.details()) from None  # type: ignore[attr-defined]
                for i, out in zip(chunks[k], outputs, strict=True):
                    yield i, Completion.from_pb(out)
                if in_flight <= 0 and sent < len(chunks) and time.monotonic() - checked > self.REPLAN_CHECK_SECONDS:
                    checked = time.monotonic()
                    new = plan_in_flight(self.server_metadata(), size)
                    if new.chunks != plan.chunks and on_plan is not None:
                        on_plan(new)
                    plan = new
        finally:
            for fut in pending.values():
                fut.cancel()

    def batch_generate_all(
        self,
        prompts: Sequence[Prompt],
        chunk_size: int = 64,
        in_flight: int = 0,
        on_result: Callable[[int, Completion], None] | None = None,
        on_plan: Callable[[InFlight], None] | None = None,
    ) -> list[Completion]:
        """`batch_as_completed` collected in input order; `on_result(index, completion)` is called
        once per row as it finishes (a progress bar)."""
        results: list[Completion | None] = [None] * len(prompts)
        for i, c in self.batch_as_completed(prompts, chunk_size, in_flight, on_plan):
            results[i] = c
            if on_result is not None:
                on_result(i, c)
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def model_info(self) -> generation_pb2.GetModelInfoResponse:
        return self.stub.GetModelInfo(
            generation_pb2.GetModelInfoRequest(), timeout=self.timeout, metadata=self._metadata
        )

    def server_metadata(self) -> generation_pb2.GetServerMetadataResponse:
        return self.stub.GetServerMetadata(
            generation_pb2.GetServerMetadataRequest(), timeout=self.timeout, metadata=self._metadata
        )

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
