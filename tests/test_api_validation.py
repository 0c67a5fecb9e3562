"""The Generation API's edge over the real scheduler (a fake backend in gpu_expert's place): every
input is checked before anything is queued (BatchGenerate names the bad input), and a stream's text
is the deltas the scheduler hands it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fake_backend import FakeBackend

from moe_lightning.api.generation.v1 import generation_pb2
from moe_lightning.client import Prompt
from moe_lightning.demo_model import build_tokenizer
from moe_lightning.placement import Placement
from moe_lightning.request import InvalidRequestError
from moe_lightning.service.errors import ResourceExhaustedError
from moe_lightning.spec import ModelSpec
from moe_lightning.tokenizer import TextTokenizer
from orchestrator.api import GenerationServicer
from orchestrator.backend import KVCapacity
from orchestrator.scheduler import Scheduler, SchedulerConfig

TOK = TextTokenizer(build_tokenizer(400, seed=1))
SPEC = ModelSpec("MixtralForCausalLM", 8, 16, 1, 2, 1, 4, 2, 1, 400, max_position_embeddings=1024)
CONTEXT: Any = SimpleNamespace(add_callback=lambda _: None)


@pytest.fixture()
def started() -> Iterator[list[Scheduler]]:
    schedulers: list[Scheduler] = []
    yield schedulers
    for s in schedulers:
        s.stop()


def _servicer(
    started: list[Scheduler], tokenizer: TextTokenizer | None = None, script: list[int] | None = None
) -> tuple[GenerationServicer, FakeBackend]:
    """An API over a running scheduler with 8 blocks of 16 KV tokens; the first request generates `script`."""
    backend = FakeBackend({1: script or [5, 6, 7]})
    kv, config = KVCapacity(8, 16, "float32"), SchedulerConfig(max_prefill_tokens=40)
    scheduler = Scheduler(SPEC, backend, tokenizer, kv, config, None, Placement())  # type: ignore[arg-type]
    scheduler.start()
    started.append(scheduler)
    servicer = GenerationServicer()
    servicer.scheduler = scheduler
    return servicer, backend


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
        (
            Prompt(token_ids=[1], max_new_tokens=200),
            ResourceExhaustedError,
            "input 2: prompt + max_new_tokens is 201 tokens",
        ),
    ],
)
def test_batch_checks_every_input_before_queueing_any(
    bad: Prompt, error: type, message: str, started: list[Scheduler]
) -> None:
    servicer, backend = _servicer(started)
    good = Prompt(token_ids=[1, 2], max_new_tokens=3)
    with pytest.raises(error) as info:
        asyncio.run(servicer.BatchGenerate(_batch(good, good, bad, good), CONTEXT))
    assert type(info.value) is error and str(info.value).startswith(message)
    assert backend.plans == [] and servicer.scheduler.stats()["waiting"] == 0  # type: ignore[union-attr]


def test_a_single_request_is_refused_before_the_scheduler_sees_it(started: list[Scheduler]) -> None:
    servicer, backend = _servicer(started)
    with pytest.raises(ResourceExhaustedError) as info:
        asyncio.run(servicer.Generate(_one(Prompt(token_ids=[1], max_new_tokens=200)), CONTEXT))
    assert (
        str(info.value) == "prompt + max_new_tokens is 201 tokens, 13 KV blocks of 16 tokens; "
        "the cache holds 128 tokens (8 blocks) in all"
    )
    with pytest.raises(InvalidRequestError, match="^this model has no tokenizer"):
        asyncio.run(servicer.Generate(_one(Prompt(text="hello")), CONTEXT))
    assert backend.plans == []


def test_a_stream_sends_the_schedulers_text_deltas(started: list[Scheduler]) -> None:
    script = TOK.encode("Kabeno tisar molu")[1:]
    servicer, _ = _servicer(started, TOK, script)
    prompt = Prompt(token_ids=[1, 2], max_new_tokens=20, stop=["o ti"])

    async def stream() -> list[generation_pb2.GenerateStreamResponse]:
        return [
            m
            async for m in servicer.GenerateStream(generation_pb2.GenerateStreamRequest(input=prompt.to_pb()), CONTEXT)
        ]

    *pieces, last = asyncio.run(stream())
    texts = [p.text for p in (*pieces, last) if p.text]  # the last token comes alone or with the output
    # the scheduler's deltas are "K", "a", "ben" ("o ti" held, then cut); a reader that fell behind
    # (this one: the scripted model is done before it reads) gets consecutive deltas in one message
    ends = {sum(map(len, texts[: i + 1])) for i in range(len(texts))}
    assert "".join(texts) == "Kaben" and ends <= {1, 2, 5}, texts
    assert last.output.text == "Kaben" and last.output.finish_reason == generation_pb2.FINISH_REASON_STOP
    assert [t for p in [*pieces, last] for t in p.token_ids] == list(last.output.token_ids) == script[:6]
