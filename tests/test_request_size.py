"""Issue 14, item 4: a huge prompt text is refused before it is tokenised (encoding holds the GIL for
a time that grows faster than the text), and the public API receives no more than a legal request needs."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from fake_backend import FakeBackend
from wire import token_ids_input

from moe_lightning.api.generation.v1 import generation_pb2, generation_pb2_grpc
from moe_lightning.chat_template import ChatTemplate
from moe_lightning.client import Prompt
from moe_lightning.demo_model import build_tokenizer
from moe_lightning.launcher import Stack
from moe_lightning.placement import Placement
from moe_lightning.request import InvalidRequestError
from moe_lightning.service.names import GENERATION as API
from moe_lightning.service.upstream import health_status, open_channel
from moe_lightning.spec import ModelSpec
from moe_lightning.tokenizer import TextTokenizer
from moe_lightning.validation import max_text_bytes
from orchestrator.api import MAX_BATCH_PROMPTS, GenerationServicer, max_receive_bytes
from orchestrator.backend import KVCapacity
from orchestrator.scheduler import Scheduler, SchedulerConfig

TOK = TextTokenizer(build_tokenizer(400, seed=1))
SPEC = ModelSpec("MixtralForCausalLM", 8, 16, 1, 2, 1, 4, 2, 1, 400, max_position_embeddings=1024)
CONTEXT: Any = SimpleNamespace(add_callback=lambda _: None)
EIGHT_MIB = "Kabeno tisar molu " * ((8 << 20) // 18)  # ~10 s to encode with this tokenizer


@pytest.fixture()
def servicer() -> Iterator[GenerationServicer]:
    kv, config = KVCapacity(8, 16, "float32"), SchedulerConfig(max_prefill_tokens=40)
    scheduler = Scheduler(SPEC, FakeBackend({}), TOK, kv, config, None, Placement())  # type: ignore[arg-type]
    scheduler.start()
    s = GenerationServicer()
    s.scheduler = scheduler
    yield s
    scheduler.stop()


def test_the_bounds_follow_max_prefill_tokens() -> None:
    assert max_text_bytes(40) == 320
    # a BatchGenerate of the most inputs, each at the bound, fits; a small server receives little
    assert max_receive_bytes(8192) >= MAX_BATCH_PROMPTS * max_text_bytes(8192)
    assert max_receive_bytes(64) < 5 << 20 and max_receive_bytes(1024) < 16 << 20


def test_an_8_mib_text_is_refused_before_tokenising(servicer: GenerationServicer) -> None:
    t0 = time.monotonic()
    with pytest.raises(InvalidRequestError, match=r"at most 320 bytes of UTF-8 \(40 tokens, --max-prefill-tokens"):
        asyncio.run(servicer.Generate(generation_pb2.GenerateRequest(input=Prompt(text=EIGHT_MIB).to_pb()), CONTEXT))
    assert time.monotonic() - t0 < 1.0
    # multi-byte text is measured in bytes: 107 characters, 321 bytes
    with pytest.raises(InvalidRequestError, match="at most 320 bytes"):
        asyncio.run(servicer.Generate(generation_pb2.GenerateRequest(input=Prompt(text="€" * 107).to_pb()), CONTEXT))
    batch = generation_pb2.BatchGenerateRequest(inputs=[Prompt(text="hi").to_pb(), Prompt(text=EIGHT_MIB).to_pb()])
    with pytest.raises(InvalidRequestError, match="^input 1: prompt text is longer than any accepted prompt"):
        asyncio.run(servicer.BatchGenerate(batch, CONTEXT))


def test_text_at_the_bound_is_tokenised_and_checked_in_tokens(servicer: GenerationServicer) -> None:
    # 320 bytes pass the size check; the token count (over 40) is what refuses them
    with pytest.raises(InvalidRequestError, match="this server accepts at most 40"):
        asyncio.run(
            servicer.Generate(
                generation_pb2.GenerateRequest(input=Prompt(text="Kabeno " * 45 + "x" * 5).to_pb()), CONTEXT
            )
        )


@pytest.fixture(scope="module")
def stack(make_module_stack: Callable[..., Stack], tiny_model: Path) -> Stack:
    # text bound 8 KiB, receive limit 12 MiB
    return make_module_stack(model=tiny_model, extra={"orchestrator": ["--max-prefill-tokens", "1024"]})


def test_a_huge_text_is_refused_at_once_while_health_answers(stack: Stack) -> None:
    ch = open_channel(stack.api_address)
    slowest, stop = [0.0], threading.Event()

    def probe() -> None:
        hch = open_channel(stack.api_address)
        while not stop.is_set():
            t = time.monotonic()
            assert health_status(hch, API, timeout=5) == 1
            slowest[0] = max(slowest[0], time.monotonic() - t)
            time.sleep(0.05)
        hch.close()

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            generation_pb2_grpc.GenerationStub(ch).Generate(
                generation_pb2.GenerateRequest(input=Prompt(text=EIGHT_MIB).to_pb()), timeout=60
            )
        took = time.monotonic() - t0
    finally:
        stop.set()
        prober.join()
        ch.close()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 8192 bytes of UTF-8 (1024 tokens, --max-prefill-tokens" in info.value.details()
    assert took < 1.0 and slowest[0] < 1.0


def test_a_message_over_the_receive_limit_is_refused_unread(stack: Stack) -> None:
    ch = open_channel(stack.api_address)  # our client sends up to 64 MiB
    batch = generation_pb2.BatchGenerateRequest(inputs=[Prompt(text="Kabeno " * 2000).to_pb()] * 1300)  # ~18 MiB
    with pytest.raises(grpc.RpcError) as info:
        generation_pb2_grpc.GenerationStub(ch).BatchGenerate(batch, timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert health_status(ch, API, timeout=5) == 1
    ch.close()


def _token_ids_input(n: int) -> generation_pb2.GenerationInput:
    """A GenerationInput of `n` token ids, parsed from its wire form as the server gets it."""
    return generation_pb2.GenerationInput.FromString(token_ids_input(n))


def test_token_ids_are_counted_before_they_are_copied(servicer: GenerationServicer) -> None:
    # issue 27, item 8: 26 M ids (26 MB, within a default server's receive limit) were made a list and
    # scanned against the vocabulary before the length check: 3.2 s and +640 MB
    m = _token_ids_input(26_000_000)
    limits = servicer._sched().limits()
    t0 = time.monotonic()
    with pytest.raises(InvalidRequestError) as info:
        servicer.to_request(m, limits)
    assert time.monotonic() - t0 < 0.1
    assert str(info.value) == "prompt has 26000000 tokens; this server accepts at most 40 (--max-prefill-tokens)"
    assert servicer.to_request(_token_ids_input(40), limits).prompt_ids == [1] * 40


def test_a_rendered_chat_is_bounded_before_it_is_tokenised(servicer: GenerationServicer) -> None:
    # issue 27, item 3: a template can multiply its input; the rendered text is bounded as any text is
    servicer.chat_template = ChatTemplate(
        "{% for m in messages %}{% for i in range(100) %}{{ m.content }}{% endfor %}{% endfor %}"
    )
    request = generation_pb2.GenerateRequest(
        input=Prompt(messages=[{"role": "user", "content": "Kabeno tisar"}]).to_pb()
    )
    with pytest.raises(
        InvalidRequestError, match="^the chat template rendered this conversation to more than 320 bytes"
    ):
        asyncio.run(servicer.Generate(request, CONTEXT))


class GatedTokenizer(TextTokenizer):
    """TOK's encoding, except that the text "gated" waits for `gate` (a tokenisation under way) and then
    comes out 100 tokens long, over the fixture's 40: the request is refused once it is let through."""

    def __init__(self) -> None:
        super().__init__(build_tokenizer(400, seed=1))  # TOK's vocabulary
        self.tokenizing, self.gate = threading.Event(), threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if text == "gated":
            self.tokenizing.set()
            assert self.gate.wait(10)
            return [1] * 100
        return super().encode(text, add_special_tokens)


def chat_input(content: str, max_new_tokens: int = 1) -> generation_pb2.GenerationInput:
    return Prompt(messages=[{"role": "user", "content": content}], max_new_tokens=max_new_tokens).to_pb()


# renders the conversation's contents, or refuses one ("refuse") in the template's own words
REFUSING = (
    "{% if messages[0].content == 'refuse' %}{{ raise_exception('refused by the template') }}{% endif %}"
    "{% for m in messages %}{{ m.content }}{% endfor %}"
)


def test_a_batch_holds_no_render_slot_while_its_other_inputs_are_tokenised() -> None:
    # review of issue 27: the slot was held for the whole of a call's checks and tokenisation, so one
    # chat in a BatchGenerate of text prompts kept a render slot while every text was tokenised, and
    # other chats were refused as busy though nothing rendered
    tok = GatedTokenizer()
    kv, config = KVCapacity(8, 16, "float32"), SchedulerConfig(max_prefill_tokens=40)
    scheduler = Scheduler(SPEC, FakeBackend({}), tok, kv, config, None, Placement())  # type: ignore[arg-type]
    scheduler.start()
    servicer = GenerationServicer(workers=2)  # one render slot (half the workers), one worker to spare
    servicer.scheduler, servicer.chat_template = scheduler, ChatTemplate(REFUSING)

    async def scenario() -> float:
        batch = generation_pb2.BatchGenerateRequest(inputs=[chat_input("Kabeno"), Prompt(text="gated").to_pb()])
        batch_call = asyncio.ensure_future(servicer.BatchGenerate(batch, CONTEXT))
        try:
            assert await asyncio.to_thread(tok.tokenizing.wait, 10)  # its chat rendered, its text being tokenised
            t0 = time.monotonic()
            with pytest.raises(InvalidRequestError, match="^refused by the template$"):  # rendered: it had the slot
                await servicer.Generate(generation_pb2.GenerateRequest(input=chat_input("refuse")), CONTEXT)
            took = time.monotonic() - t0
        finally:
            tok.gate.set()
            with pytest.raises(InvalidRequestError, match="^input 1: prompt has 100 tokens"):
                await batch_call
        return took

    try:
        took = asyncio.run(scenario())
    finally:
        scheduler.stop()
    assert took < 1.0  # not the render timeout's 2 s wait, then RESOURCE_EXHAUSTED


class GatedRenderer:
    """A stand-in for TemplateRenderer: each render is recorded, and waits while its content's gate is
    clear; `running` counts the renders under way."""

    def __init__(self, processes: int, timeout: float = 10.0) -> None:
        self.processes, self.timeout = processes, timeout
        self.order: list[str] = []
        self.gates: dict[str, threading.Event] = {}
        self.started: dict[str, threading.Event] = {}
        self.running = self.most = 0
        self._lock = threading.Lock()

    def gate(self, content: str) -> threading.Event:
        self.started.setdefault(content, threading.Event())
        return self.gates.setdefault(content, threading.Event())

    def render(self, messages: Any, add_generation_prompt: bool = True, cancel: Any = None, **extra: Any) -> str:
        content = messages[0].content
        with self._lock:
            self.order.append(content)
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            self.started.setdefault(content, threading.Event()).set()
            gate = self.gates.get(content)
            assert gate is None or gate.wait(10)
            return content
        finally:
            with self._lock:
                self.running -= 1


def test_a_batch_of_chats_takes_a_render_slot_for_each_render_only(servicer: GenerationServicer) -> None:
    # a BatchGenerate of many chats held one slot for all its renders (1024 of them: up to 1024 x the
    # timeout); a render slot is now taken for one render and given back, so another call's chat
    # renders between two of the batch's
    renderer = GatedRenderer(processes=1)
    servicer.chat_template, servicer.renderer = ChatTemplate(REFUSING), renderer  # type: ignore[assignment]
    first = renderer.gate("a")

    async def scenario() -> None:
        batch = generation_pb2.BatchGenerateRequest(inputs=[chat_input("a"), chat_input("b")])
        batch_call = asyncio.ensure_future(servicer.BatchGenerate(batch, CONTEXT))
        assert await asyncio.to_thread(renderer.started["a"].wait, 10)
        other = asyncio.ensure_future(servicer.Generate(generation_pb2.GenerateRequest(input=chat_input("c")), CONTEXT))
        deadline = time.monotonic() + 10
        while not servicer._render_slots._waiters:  # type: ignore[union-attr]  # the other call waits for the slot
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        first.set()
        await asyncio.wait_for(asyncio.gather(batch_call, other), 20)

    asyncio.run(scenario())
    assert renderer.order == ["a", "c", "b"] and renderer.most == 1


def test_renders_waiting_for_a_slot_hold_no_worker(servicer: GenerationServicer) -> None:
    # the guarantee the slots keep: however many chats wait on renders, text prompts keep their workers
    # (the servicer's 8 workers, 2 slots; 12 chats whose renders do not end until released)
    renderer = GatedRenderer(processes=2)
    servicer.chat_template, servicer.renderer = ChatTemplate(REFUSING), renderer  # type: ignore[assignment]
    for i in range(12):
        renderer.gate(f"c{i}")

    async def scenario() -> float:
        chats = [
            asyncio.ensure_future(servicer.Generate(generation_pb2.GenerateRequest(input=chat_input(f"c{i}")), CONTEXT))
            for i in range(12)
        ]
        deadline = time.monotonic() + 10
        while renderer.running < 2:  # both slots' renders under way, ten chats waiting for a slot
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(InvalidRequestError, match="this server accepts at most 40"):
            text = Prompt(text="Kabeno " * 45).to_pb()
            await asyncio.wait_for(servicer.Generate(generation_pb2.GenerateRequest(input=text), CONTEXT), 5)
        took = time.monotonic() - t0
        for gate in renderer.gates.values():
            gate.set()
        await asyncio.gather(*chats, return_exceptions=True)
        return took

    took = asyncio.run(scenario())
    assert took < 1.0 and renderer.most == 2
