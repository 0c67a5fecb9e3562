"""The public API under random input, a full queue, cancellation and 64 concurrent clients, against
the real stack: every answer is a result or a documented status, nothing is lost or answered twice,
and the server is healthy afterwards."""

from __future__ import annotations

import random
import re
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_lightning.api.generation.v1 import generation_pb2, generation_pb2_grpc
from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.launcher import Stack
from moe_lightning.service.names import GENERATION as API
from moe_lightning.service.upstream import health_status, open_channel

from reference import E2E_PROMPTS as PROMPTS

# what the README's bad-input table documents for requests that are not served
DOCUMENTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def stack(make_module_stack: Callable[..., Stack]) -> Stack:
    return make_module_stack(extra={"orchestrator": ["--max-queue", "256", "--max-prefill-tokens", "64"]})


def _healthy(stack: Stack) -> bool:
    ch = open_channel(stack.api_address)
    try:
        return health_status(ch, API, timeout=5) == 1
    finally:
        ch.close()


def _requests_total(stack: Stack) -> Counter[str]:
    with urllib.request.urlopen(stack.endpoints()["orchestrator"]["metrics"], timeout=10) as r:
        text = r.read().decode()
    return Counter(
        {m[1]: float(m[2]) for m in re.finditer(r'^moe_lightning_requests_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}
    )


floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, -0.0]))
requests = st.fixed_dictionaries(
    {
        "token_ids": st.lists(st.integers(-(2**31), 2**31 - 1) | st.integers(0, 400), max_size=80),
        "max_new_tokens": st.integers(-3, 6) | st.integers(400, 2**31 - 1),
        "temperature": floats,
        "top_p": floats,
        "top_k": st.integers(-(2**31), 2**31 - 1) | st.integers(0, 50),
        "seed": st.none() | st.integers(0, 2**63 - 1),
        "stop": st.lists(st.text(max_size=12), max_size=20),
        "ignore_eos": st.booleans(),
        "logprobs": st.integers(0, 40),  # above 20 is refused
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=requests)
def test_random_requests_get_a_result_or_a_documented_status(stack: Stack, req: dict) -> None:
    with GenerationClient(stack.api_address, timeout=60) as c:
        try:
            out = c.generate(Prompt(**req))
        except grpc.RpcError as exc:
            assert exc.code() in DOCUMENTED, (req, exc.code(), exc.details())
            assert exc.details(), "a rejection must say why"
        else:
            assert 1 <= len(out.token_ids) <= req["max_new_tokens"]
            assert len(out.logprobs) == (len(out.token_ids) if req["logprobs"] else 0)
    assert _healthy(stack)


def test_batch_of_zero_or_too_many_inputs(stack: Stack) -> None:
    with GenerationClient(stack.api_address, timeout=30) as c:
        for n in (0, 1025):
            with pytest.raises(grpc.RpcError) as info:
                c.batch_generate([Prompt(token_ids=[1, 2])] * n)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "1 to 1024" in info.value.details()


def test_invalid_utf8_in_a_stop_string(stack: Stack) -> None:
    good = generation_pb2.GenerateRequest(
        input=Prompt(token_ids=[1, 2], max_new_tokens=2, stop=["XY"]).to_pb()
    ).SerializeToString()
    bad = good.replace(b"XY", b"\xff\xfe")  # same length: still a well-formed message, not UTF-8
    ch = open_channel(stack.api_address)
    call = ch.unary_unary(f"/{API}/Generate")
    with pytest.raises(grpc.RpcError) as info:
        call(bad, timeout=30)
    ch.close()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "must be valid UTF-8" in info.value.details()
    assert _healthy(stack)


def test_an_oversized_message_is_refused(stack: Stack) -> None:
    # a client that would send it: ours caps its own messages at the server's 64 MiB limit
    ch = grpc.insecure_channel(stack.api_address, options=[("grpc.max_send_message_length", 256 << 20)])
    big = generation_pb2.GenerationInput()
    big.token_ids.ids.extend([2**30] * (14 << 20))  # 5 bytes each: ~70 MiB
    with pytest.raises(grpc.RpcError) as info:
        generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(input=big), timeout=60)
    ch.close()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _healthy(stack)


def test_cancel_and_deadline_free_the_request_and_spare_the_others(stack: Stack, reference: dict) -> None:
    ch = open_channel(stack.api_address)
    stub = generation_pb2_grpc.GenerationStub(ch)
    long = generation_pb2.GenerateStreamRequest(
        input=Prompt(token_ids=PROMPTS[1], max_new_tokens=400, ignore_eos=True).to_pb()
    )
    before = _requests_total(stack)
    with GenerationClient(stack.api_address, timeout=60) as c:
        others: list = []
        worker = threading.Thread(
            target=lambda: others.extend(
                c.batch_generate([Prompt(token_ids=p, max_new_tokens=14) for p in PROMPTS[:4]])
            )
        )
        call = stub.GenerateStream(long)
        next(call)  # it is running
        worker.start()
        call.cancel()
        with pytest.raises(grpc.RpcError) as info:  # a deadline ends a request the same way
            stub.Generate(generation_pb2.GenerateRequest(input=long.input), timeout=0.5)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        worker.join(60)
    assert [o.token_ids for o in others] == [reference[i] for i in range(4)]
    deadline = time.monotonic() + 10
    while _requests_total(stack)["cancelled"] - before["cancelled"] < 2:  # both stopped at the next step
        assert time.monotonic() < deadline, _requests_total(stack)
        time.sleep(0.1)
    ch.close()

    def kv_blocks_used() -> float:
        with urllib.request.urlopen(stack.endpoints()["cpu_attention"]["metrics"], timeout=10) as r:
            used = re.search(r'^moe_lightning_kv_cache_blocks\{state="used"\} (\S+)$', r.read().decode(), re.M)
        assert used
        return float(used[1])

    deadline = time.monotonic() + 10  # released through the next plan: the idle scheduler sends one at once
    while kv_blocks_used() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv_blocks_used() == 0.0  # their KV blocks were freed


def test_a_full_queue_refuses_at_once(make_stack: Callable[..., Stack]) -> None:
    s = make_stack(kv_cache_memory="16MiB", max_batch_size=1, extra={"orchestrator": ["--max-queue", "2"]})
    results: list = []

    def one() -> None:
        t0 = time.monotonic()
        try:
            with GenerationClient(s.api_address, timeout=60) as c:
                c.generate(Prompt(token_ids=PROMPTS[0], max_new_tokens=200, ignore_eos=True))
            results.append(("ok", time.monotonic() - t0))
        except grpc.RpcError as exc:
            results.append((exc.code(), time.monotonic() - t0, exc.details()))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    s.stop()
    refused = [r for r in results if r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert refused and all(r[1] < 2.0 and "queue is full" in r[2] for r in refused), results
    assert len(results) == 8 and all(r[0] in ("ok", grpc.StatusCode.RESOURCE_EXHAUSTED) for r in results)


def test_64_clients_8_requests_each(stack: Stack, reference: dict) -> None:
    """Mixed lengths, some streaming, some cancelled: every other request completes exactly once
    with the tokens it gets alone (greedy: a prefix of the reference), and the counters add up."""
    before = _requests_total(stack)
    rng = random.Random(0)
    plans = [[(rng.randrange(len(PROMPTS)), rng.randint(1, 14), rng.random()) for _ in range(8)] for _ in range(64)]
    outcomes: list[tuple[str, int, int, list[int]]] = []  # (kind, prompt, n, tokens)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(plan: list[tuple[int, int, float]]) -> None:
        try:
            with GenerationClient(stack.api_address, timeout=300) as c:
                stub = generation_pb2_grpc.GenerationStub(c.channel)
                for i, n, r in plan:
                    prompt = Prompt(token_ids=PROMPTS[i], max_new_tokens=n)
                    if r < 0.1:  # cancelled after its first streamed tokens
                        call = stub.GenerateStream(generation_pb2.GenerateStreamRequest(input=prompt.to_pb()))
                        next(call)
                        call.cancel()
                        kind, tokens = "cancelled", []
                    elif r < 0.4:
                        pieces = list(c.stream(prompt))
                        kind, tokens = "stream", pieces[-1].token_ids
                        assert [t for p in pieces[:-1] for t in p.token_ids] == tokens  # adds up to the result
                    else:
                        kind, tokens = "unary", c.generate(prompt).token_ids
                    with lock:
                        outcomes.append((kind, i, n, tokens))
        except BaseException as exc:  # reported below, with the others
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(p,)) for p in plans]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:3]
    assert len(outcomes) == 64 * 8, "a request was lost"
    for kind, i, n, tokens in outcomes:
        if kind != "cancelled":
            assert tokens == reference[i][:n], (kind, i, n)
    done = sum(1 for o in outcomes if o[0] != "cancelled")
    deadline = time.monotonic() + 10
    while True:
        after = _requests_total(stack)
        finished = sum(after[k] - before[k] for k in ("length", "eos", "stop"))
        cancelled = after["cancelled"] - before["cancelled"]
        # each request is counted exactly once; a cancel that raced its request's last token counts
        # as finished instead (the server had already answered)
        if finished + cancelled == 64 * 8:
            break
        assert time.monotonic() < deadline, (done, finished, cancelled)
        time.sleep(0.2)
    assert done <= finished and cancelled <= 64 * 8 - done
    print(f"512 requests from 64 clients in {time.monotonic() - t0:.1f} s")
    assert _healthy(stack)


def test_requests_wait_for_kv_blocks_and_a_too_large_one_is_refused(
    make_stack: Callable[..., Stack], reference: dict
) -> None:
    """A KV cache of 8 blocks (16 tokens each) holds two of these requests at a time: the others
    wait their turn and still get exactly their tokens; one that could never fit is refused."""
    s = make_stack(kv_cache_memory="96KiB")
    with GenerationClient(s.api_address, timeout=120) as c:
        assert c.server_metadata().kv_cache_tokens == 8 * 16
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=14) for p in PROMPTS])
        with pytest.raises(grpc.RpcError) as info:
            c.generate(Prompt(token_ids=PROMPTS[0], max_new_tokens=200))
    s.stop()
    assert [d.token_ids for d in done] == [reference[i] for i in range(len(PROMPTS))]
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "14 KV blocks of 16 tokens; the cache holds 128 tokens (8 blocks) in all" in info.value.details()
