"""How far one request, or a burst of calls, fans out, through a real stack (issue 27): a prompt list is
bounded (prompts x n at most the server's max_batch_prompts) and is one BatchGenerate, which a client
that leaves cancels whole; the public API takes --max-concurrent-rpcs calls at once and answers the next
RESOURCE_EXHAUSTED, named and counted, while every call below it completes (grpc core used to drop a
burst's calls past 1000 waiting as CANCELLED, unseen and uncounted: moe_lightning/service/aio_runtime.py);
and no body reaches a plain-text 500."""

from __future__ import annotations

import asyncio
import collections
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from moe_lightning.api.generation.v1 import generation_pb2, generation_pb2_grpc
from moe_lightning.launcher import Stack
from moe_lightning.service.aio_runtime import AioErrorMappingInterceptor
from moe_lightning.service.concurrency import AioConcurrencyLimit, pending_call_options

LIMIT = 3200  # --max-concurrent-rpcs: above the 3,000 calls that grpc core's backlog used to cut
MAX_BATCH_PROMPTS = 1024  # orchestrator/api.py


@pytest.fixture(scope="module")
def stack(make_module_stack: Callable[..., Stack], tiny_model: Path) -> Stack:
    flags = ["--max-queue", "5000", "--max-concurrent-rpcs", str(LIMIT)]
    return make_module_stack(
        model=tiny_model, http_port=0, max_batch_size=64, kv_cache_memory="64MiB", extra={"orchestrator": flags}
    )


@pytest.fixture(scope="module")
def model_id(stack: Stack) -> str:
    return stack.config.model.name


def metric(stack: Stack, name: str, **labels: str) -> float:
    """One sample of the orchestrator's /metrics (0 when absent)."""
    with urllib.request.urlopen(stack.endpoints()["orchestrator"]["metrics"], timeout=10) as r:
        text = r.read().decode()
    for m in re.finditer(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m[1] or ""))
        if got == labels:
            return float(m[2])
    return 0.0


def handled(stack: Stack, method: str, code: str) -> float:
    return metric(stack, "moe_lightning_rpc_handled_total", method=method, code=code)


def wait_idle(stack: Stack, timeout: float = 60.0) -> None:
    """Until the scheduler holds nothing and no call is in its handler."""
    deadline = time.monotonic() + timeout
    names = ("moe_lightning_requests_running", "moe_lightning_requests_waiting", "moe_lightning_rpcs_in_progress")
    while any(metric(stack, n) for n in names):
        held = {n: metric(stack, n) for n in names}
        assert time.monotonic() < deadline, f"still held after {timeout} s: {held}"
        time.sleep(0.2)


def test_a_prompt_list_over_the_limit_is_refused_naming_it(stack: Stack, model_id: str) -> None:
    url = f"{stack.http_address}/v1/completions"
    calls = {m: handled(stack, m, "OK") for m in ("Generate", "BatchGenerate")}
    for prompts, n in ((MAX_BATCH_PROMPTS + 1, 1), (MAX_BATCH_PROMPTS // 2 + 1, 2)):
        body = {"model": model_id, "prompt": ["x"] * prompts, "n": n, "max_tokens": 1}
        for stream in (False, True):
            r = httpx.post(url, json={**body, "stream": stream}, timeout=60)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "prompt" and error["type"] == "invalid_request_error"
            assert f"at most {MAX_BATCH_PROMPTS}" in error["message"] and "max_batch_prompts" in error["message"]
    assert {m: handled(stack, m, "OK") for m in calls} == calls  # refused before any call


def test_a_refused_prompt_of_a_list_is_named_by_its_index(stack: Stack, model_id: str) -> None:
    """The list is one BatchGenerate, whose refusal names the flattened row (`input 5`): the client sees
    the prompt it sent (`prompt 2`)."""
    url = f"{stack.http_address}/v1/completions"
    body = {"model": model_id, "prompt": [[1, 2], [3], [4, 10**6]], "n": 2, "max_tokens": 1}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("prompt 2: prompt token ids [1000000] are outside the vocabulary"), message


def test_a_list_at_the_limit_is_one_batch_generate(stack: Stack, model_id: str) -> None:
    batch, unary = handled(stack, "BatchGenerate", "OK"), handled(stack, "Generate", "OK")
    c = openai.OpenAI(base_url=f"{stack.http_address}/v1", api_key="unused", max_retries=0, timeout=300)
    prompts = [f"p {i}" for i in range(MAX_BATCH_PROMPTS)]
    r = c.completions.create(model=model_id, prompt=prompts, max_tokens=1, temperature=0)
    assert [ch.index for ch in r.choices] == list(range(MAX_BATCH_PROMPTS))
    assert r.usage is not None and r.usage.completion_tokens == MAX_BATCH_PROMPTS
    assert handled(stack, "BatchGenerate", "OK") == batch + 1  # one call for the whole list
    assert handled(stack, "Generate", "OK") == unary


def test_a_client_that_leaves_mid_list_cancels_all_of_it(stack: Stack, model_id: str) -> None:
    wait_idle(stack)
    calls = handled(stack, "BatchGenerate", "CANCELLED")
    cancelled = metric(stack, "moe_lightning_requests_total", outcome="cancelled")
    prompts = [f"long {i}" for i in range(256)]  # 4 full batches of 500 steps: minutes here
    body = {"model": model_id, "prompt": prompts, "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stack.http_address}/v1/completions", json=body, timeout=2.0)
    wait_idle(stack, timeout=30)  # every one of the 256 stopped, running or waiting
    assert handled(stack, "BatchGenerate", "CANCELLED") == calls + 1
    assert metric(stack, "moe_lightning_requests_total", outcome="cancelled") == cancelled + len(prompts)


def test_a_passed_deadline_is_counted_as_one_not_as_a_cancel(stack: Stack) -> None:
    wait_idle(stack)
    deadlines, cancels = handled(stack, "Generate", "DEADLINE_EXCEEDED"), handled(stack, "Generate", "CANCELLED")
    with grpc.insecure_channel(stack.api_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        m = generation_pb2.GenerationInput(token_ids=generation_pb2.TokenIds(ids=[1, 2]), max_new_tokens=500)
        m.ignore_eos = True
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(generation_pb2.GenerateRequest(input=m), timeout=0.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(stack, timeout=30)
    assert handled(stack, "Generate", "DEADLINE_EXCEEDED") == deadlines + 1
    assert handled(stack, "Generate", "CANCELLED") == cancels


class Burst:
    """What `n` unary Generate calls fired at once on one channel came back with."""

    def __init__(self) -> None:
        self.codes: collections.Counter[str] = collections.Counter()
        self.messages: set[str] = set()


async def _burst(address: str, n: int, max_new_tokens: int, arrived: Callable[[], float] | None = None) -> Burst:
    """`n` Generate calls at once. With `arrived` (the server's count of calls in progress), once every
    call was answered or is in progress there, the ones in progress are cancelled (by us)."""
    out = Burst()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(i: int) -> None:
            m = generation_pb2.GenerationInput(text=f"call {i}", max_new_tokens=max_new_tokens, ignore_eos=True)
            try:
                await stub.Generate(generation_pb2.GenerateRequest(input=m))
                out.codes["OK"] += 1
            except grpc.aio.AioRpcError as exc:
                out.codes[exc.code().name] += 1
                out.messages.add(exc.details() or "")

        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        if arrived is None:
            await asyncio.gather(*tasks)
            return out
        deadline = time.monotonic() + 120
        while sum(out.codes.values()) + await asyncio.to_thread(arrived) < n:
            assert time.monotonic() < deadline, f"calls unaccounted for: {out.codes}"
            await asyncio.sleep(0.2)
        answered = Burst()
        answered.codes, answered.messages = collections.Counter(out.codes), set(out.messages)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return answered


def test_3000_concurrent_unary_calls_below_the_limit_all_complete(stack: Stack) -> None:
    wait_idle(stack)
    ok, cancelled = handled(stack, "Generate", "OK"), handled(stack, "Generate", "CANCELLED")
    out = asyncio.run(_burst(stack.api_address, 3000, max_new_tokens=1))
    assert out.codes == {"OK": 3000}  # none CANCELLED, none refused: 3,000 is below --max-concurrent-rpcs
    assert handled(stack, "Generate", "OK") == ok + 3000
    assert handled(stack, "Generate", "CANCELLED") == cancelled
    assert metric(stack, "moe_lightning_max_concurrent_rpcs") == LIMIT


def test_calls_beyond_the_limit_get_resource_exhausted_named_and_counted(stack: Stack) -> None:
    wait_idle(stack)
    extra = 200
    refused = handled(stack, "Generate", "RESOURCE_EXHAUSTED")
    by_reason = metric(stack, "moe_lightning_rpc_refused_total", reason="concurrency")
    # generations of 1000 tokens: few end while the burst arrives, so about `extra` find no place
    out = asyncio.run(
        _burst(
            stack.api_address,
            LIMIT + extra,
            max_new_tokens=1000,
            arrived=lambda: metric(stack, "moe_lightning_rpcs_in_progress"),
        )
    )
    assert set(out.codes) <= {"OK", "RESOURCE_EXHAUSTED"}, out.codes  # nothing CANCELLED, nothing else
    assert 0 < out.codes["RESOURCE_EXHAUSTED"] <= extra + out.codes["OK"], out.codes
    assert out.messages == {
        f"{LIMIT} calls are in progress, the most this server takes at once (--max-concurrent-rpcs {LIMIT}); "
        "retry later, or send a list of prompts as one BatchGenerate"
    }
    assert handled(stack, "Generate", "RESOURCE_EXHAUSTED") == refused + out.codes["RESOURCE_EXHAUSTED"]
    assert (
        metric(stack, "moe_lightning_rpc_refused_total", reason="concurrency")
        == by_reason + out.codes["RESOURCE_EXHAUSTED"]
    )
    wait_idle(stack)  # the calls we cancelled freed their places


class _Held(generation_pb2_grpc.GenerationServicer):
    """Calls that wait until released: as many in progress at once as arrive."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def Generate(self, request: object, context: object) -> generation_pb2.GenerateResponse:  # type: ignore[override]
        await self.release.wait()
        return generation_pb2.GenerateResponse()

    async def GenerateStream(self, request: object, context: object):  # type: ignore[no-untyped-def,override]
        await self.release.wait()
        yield generation_pb2.GenerateStreamResponse()


async def _in_process(options: list[tuple[str, int]], limit: AioConcurrencyLimit | None, calls: int) -> Burst:
    """`calls` Generate calls (and, with a limit, as many GenerateStream calls beside) at a held
    servicer; released once every call was answered or is in progress."""
    interceptors = (limit,) if limit is not None else ()
    server = grpc.aio.server(interceptors=(*interceptors, AioErrorMappingInterceptor()), options=options)
    servicer = _Held()
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out = Burst()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            async def one(stream: bool) -> None:
                try:
                    if stream:
                        async for _ in stub.GenerateStream(generation_pb2.GenerateStreamRequest()):
                            pass
                    else:
                        await stub.Generate(generation_pb2.GenerateRequest())
                    out.codes["OK"] += 1
                except grpc.aio.AioRpcError as exc:
                    out.codes[exc.code().name] += 1
                    out.messages.add(exc.details() or "")

            tasks = [asyncio.ensure_future(one(i % 2 == 1 and limit is not None)) for i in range(calls)]
            deadline = time.monotonic() + 60
            while limit is not None and sum(out.codes.values()) + limit.active < calls:
                assert time.monotonic() < deadline, out.codes
                await asyncio.sleep(0.05)
            if limit is None:
                await asyncio.sleep(0.5)  # let the burst arrive before it is released
            servicer.release.set()
            await asyncio.gather(*tasks)
    finally:
        await server.stop(None)
    return out


def test_a_burst_of_3000_calls_is_not_cut_by_grpc_cores_backlog() -> None:
    """The cause of the CANCELLED calls, in process: grpc core drops calls waiting for the event loop to
    take them past grpc.server.max_pending_requests (1000; every one past 3000). A server with a limit
    raises it to twice the limit; core's own bound is what a server without one keeps."""
    out = asyncio.run(_in_process(pending_call_options(3000), None, 3000))
    assert out.codes == {"OK": 3000}
    assert pending_call_options(None) == []
    assert dict(pending_call_options(10_240))["grpc.server.max_pending_requests_hard_limit"] == 20_480


def test_the_limit_refuses_exactly_the_calls_past_it_named_and_counted() -> None:
    refused: list[int] = []
    limit = AioConcurrencyLimit(100, "--max-concurrent-rpcs", lambda: refused.append(1))
    out = asyncio.run(_in_process(pending_call_options(100), limit, 130))
    assert out.codes == {"OK": 100, "RESOURCE_EXHAUSTED": 30}  # unary and streaming calls alike
    assert out.messages == {
        "100 calls are in progress, the most this server takes at once (--max-concurrent-rpcs 100); "
        "retry later, or send a list of prompts as one BatchGenerate"
    }
    assert len(refused) == 30 and limit.active == 0


BAD_BODIES = [
    (b'{"model": "M", "prompt": "a \\ud800 b"}', "prompt"),
    (b'{"model": "M", "prompt": "a", "stop": ["\\udfff"]}', "stop.0"),
    (b'{"model": "M", "prompt": "a", "max_tokens": 2147483648}', "max_tokens"),
    (b'{"model": "M", "prompt": "a", "seed": 18446744073709551616}', "seed"),
    (b'{"model": "M", "prompt": "a", "top_k": 1099511627776}', "top_k"),
    (b'{"model": "M", "prompt": [1, 18446744073709551616]}', "prompt"),
    (b'{"model": "M", "prompt": "a", "tools": [{"type": "function"}]}', "tools"),
]


@pytest.mark.parametrize(("raw", "param"), BAD_BODIES)
def test_no_body_reaches_a_plain_text_500(stack: Stack, model_id: str, raw: bytes, param: str) -> None:
    raw = raw.replace(b'"M"', f'"{model_id}"'.encode())
    r = httpx.post(
        f"{stack.http_address}/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"].startswith(f"{param}: ")
