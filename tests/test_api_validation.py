"""The Generation API's edge, against a stand-in scheduler: every input is checked before anything is
queued (BatchGenerate names the bad input), and a stream's text is the deltas the scheduler hands it."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from moe_lightning.api.generation.v1 import generation_pb2
from moe_lightning.client import Prompt
from moe_lightning.demo_model import build_tokenizer
from moe_lightning.output_text import OutputText
from moe_lightning.request import GenerationRequest, GenerationResult, InvalidRequestError
from moe_lightning.service.errors import ResourceExhaustedError
from moe_lightning.spec import ModelSpec
from moe_lightning.tokenizer import TextTokenizer
from orchestrator.api import GenerationServicer, StreamSink

TOK = TextTokenizer(build_tokenizer(400, seed=1))
SPEC = ModelSpec("MixtralForCausalLM", 8, 16, 1, 2, 1, 4, 2, 1, 400, max_position_embeddings=1024)
CONTEXT: Any = SimpleNamespace(add_callback=lambda _: None)


class _Ticket:
    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.result: GenerationResult | None = None
        self.arrival = self.admitted = self.first_token = self.finished = 0.0

    def wait(self, timeout: float | None = None) -> GenerationResult:
        assert self.done.wait(timeout) and self.result is not None
        return self.result


class _Scheduler:
    """Runs a request at once on `script` (its generated tokens) the way the scheduler should: one
    OutputText per request, its delta handed to the stream sink before the ticket is marked done."""

    def __init__(self, tokenizer: TextTokenizer | None, script: list[int] | None = None) -> None:
        self.spec, self.tokenizer, self.script = SPEC, tokenizer, script or [5, 6, 7]
        self.config = SimpleNamespace(max_prefill_tokens=40)
        self.kv_blocks, self.block_size = 8, 16
        self.submitted: list[GenerationRequest] = []
        self.cancelled: list[_Ticket] = []

    def submit(self, request: GenerationRequest, on_tokens: StreamSink | None = None) -> _Ticket:
        self.submitted.append(request)
        ticket, text = _Ticket(request), OutputText(request, SPEC.eos_token_ids, self.tokenizer, stream=True)
        reason = None
        for token in self.script:
            delta, reason = text.append(token)
            if on_tokens is not None:
                on_tokens([token], [], delta)
            if reason is not None:
                break
        ticket.result = GenerationResult(text.token_ids, text.final_text, reason or "", len(request.prompt_ids))
        ticket.done.set()
        return ticket

    def cancel(self, ticket: _Ticket) -> None:
        self.cancelled.append(ticket)


def _servicer(tokenizer: TextTokenizer | None = None, script: list[int] | None = None) -> GenerationServicer:
    servicer = GenerationServicer()
    servicer.scheduler = _Scheduler(tokenizer, script)  # type: ignore[assignment]
    return servicer


def _one(prompt: Prompt) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(input=prompt.to_pb())


def _batch(*prompts: Prompt) -> generation_pb2.BatchGenerateRequest:
    return generation_pb2.BatchGenerateRequest(inputs=[p.to_pb() for p in prompts])


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        (Prompt(token_ids=[1], top_p=0.0), InvalidRequestError, "input 2: top_p must be in (0, 1], got 0.0"),
        (Prompt(token_ids=[1, 400]), InvalidRequestError, "input 2: prompt token ids [400] are outside"),
        (Prompt(token_ids=[1] * 41), InvalidRequestError, "input 2: prompt has 41 tokens; this server accepts"),
        (Prompt(token_ids=[1], stop=["x"]), InvalidRequestError, "input 2: stop strings need the model's"),
        (Prompt(token_ids=[1], max_new_tokens=200), ResourceExhaustedError, "input 2: prompt + max_new_tokens needs"),
    ],
)
def test_batch_checks_every_input_before_queueing_any(bad: Prompt, error: type, message: str) -> None:
    servicer = _servicer()
    good = Prompt(token_ids=[1, 2], max_new_tokens=3)
    with pytest.raises(error) as info:
        servicer.BatchGenerate(_batch(good, good, bad, good), CONTEXT)
    assert type(info.value) is error and str(info.value).startswith(message)
    assert servicer.scheduler.submitted == []  # type: ignore[union-attr]


def test_a_single_request_is_refused_before_the_scheduler_sees_it() -> None:
    servicer = _servicer()
    with pytest.raises(ResourceExhaustedError) as info:
        servicer.Generate(_one(Prompt(token_ids=[1], max_new_tokens=200)), CONTEXT)
    assert str(info.value) == "prompt + max_new_tokens needs 208 KV tokens; the cache holds 128 in all"
    with pytest.raises(InvalidRequestError, match="^this model has no tokenizer"):
        servicer.Generate(_one(Prompt(text="hello")), CONTEXT)
    assert servicer.scheduler.submitted == []  # type: ignore[union-attr]


def test_a_stream_sends_the_schedulers_text_deltas() -> None:
    script = TOK.encode("Kabeno tisar molu")[1:]
    servicer = _servicer(TOK, script)
    prompt = Prompt(token_ids=[1, 2], max_new_tokens=20, stop=["o ti"])
    *pieces, last = servicer.GenerateStream(generation_pb2.GenerateStreamRequest(input=prompt.to_pb()), CONTEXT)
    assert [p.text for p in pieces] == ["K", "a", "ben", "", ""] and last.text == ""  # "o ti" held, then cut
    assert last.output.text == "Kaben" and last.output.finish_reason == generation_pb2.FINISH_REASON_STOP
    assert [t for p in [*pieces, last] for t in p.token_ids] == list(last.output.token_ids) == script[:6]
