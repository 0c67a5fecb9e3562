"""A small Python client for the public Generation API."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from moe_lightning.api.generation.v1 import generation_pb2, generation_pb2_grpc
from moe_lightning.service.upstream import CHANNEL_OPTIONS

FINISH_NAMES = {
    generation_pb2.FINISH_REASON_EOS: "eos",
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
}


@dataclass(slots=True)
class Prompt:
    """One generation input; give `text` or `token_ids`."""

    text: str | None = None
    token_ids: list[int] | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    request_id: str = ""
    logprobs: int = 0  # top log-probabilities per generated token (0..20)

    def to_pb(self) -> generation_pb2.GenerationInput:
        m = generation_pb2.GenerationInput(
            stop=self.stop, ignore_eos=self.ignore_eos, request_id=self.request_id, logprobs=self.logprobs
        )
        if self.token_ids is not None:
            m.token_ids.ids.extend(self.token_ids)
        elif self.text is not None:
            m.text = self.text
        for name in ("max_new_tokens", "temperature", "top_k", "top_p", "seed"):
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
        )

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]
        if not out["logprobs"]:
            del out["logprobs"]  # keeps job outputs' columns as they were when nobody asked
        return out


class GenerationClient:
    def __init__(
        self, address: str, timeout: float | None = None, tls_ca: Path | None = None, token: str | None = None
    ) -> None:
        """`tls_ca`: PEM root certificate(s) to verify a TLS server with (None: plaintext);
        `token`: sent as 'authorization: Bearer <token>' on every call."""
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

    def stream(self, prompt: Prompt) -> Iterator[StreamChunk | Completion]:
        """Yields a StreamChunk per step as tokens come, then the Completion."""
        for msg in self.stub.GenerateStream(
            generation_pb2.GenerateStreamRequest(input=prompt.to_pb()), timeout=self.timeout, metadata=self._metadata
        ):
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
