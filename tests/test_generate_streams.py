"""GenerateStreams, many GenerateStreams on one call, through a real stack: each stream's messages add
up to its GenerateStream's, a step's pieces share a message, a stream's error or cancel touches no
other stream, and a malformed request ends the call (docs/api.md, "Many streams on one call")."""

from __future__ import annotations

import asyncio
import queue
import re
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from moe_lightning.api.generation.v1 import generation_pb2, generation_pb2_grpc
from moe_lightning.launcher import Stack
from orchestrator.streams import MAX_RESPONSE_BYTES, Stream, generate_streams

GI = generation_pb2.GenerationInput


@pytest.fixture(scope="module")
def stack(make_module_stack: Callable[..., Stack], tiny_model: Path) -> Stack:
    return make_module_stack(model=tiny_model, max_batch_size=64, kv_cache_memory="64MiB")


def start(sid: int, **fields: object) -> generation_pb2.GenerateStreamsRequest:
    return generation_pb2.GenerateStreamsRequest(
        id=sid,
        start=generation_pb2.GenerateStreamRequest(input=GI(**fields)),  # type: ignore[arg-type]
    )


class Call:
    """A GenerateStreams call whose requests are sent as the test goes."""

    def __init__(self, stack: Stack) -> None:
        self.channel = grpc.insecure_channel(stack.api_address)
        self.requests: queue.Queue[generation_pb2.GenerateStreamsRequest | None] = queue.Queue()
        stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.responses = stub.GenerateStreams(iter(self.requests.get, None), timeout=120)

    def send(self, r: generation_pb2.GenerateStreamsRequest) -> None:
        self.requests.put(r)

    def half_close(self) -> None:
        self.requests.put(None)

    def __enter__(self) -> Call:
        return self

    def __exit__(self, *exc: object) -> None:
        self.half_close()
        self.responses.cancel()
        self.channel.close()


def grpc_stream(stack: Stack, **fields: object) -> list[generation_pb2.GenerateStreamResponse]:
    with grpc.insecure_channel(stack.api_address) as ch:
        request = generation_pb2.GenerateStreamRequest(input=GI(**fields))  # type: ignore[arg-type]
        return list(generation_pb2_grpc.GenerationStub(ch).GenerateStream(request, timeout=60))


def joined(messages: list[generation_pb2.GenerateStreamResponse]) -> tuple[list[int], str, str]:
    outputs = [m.output for m in messages if m.HasField("output")]
    assert len(outputs) == 1 and messages[-1].HasField("output")  # the output comes last, once
    return [t for m in messages for t in m.token_ids], "".join(m.text for m in messages), outputs[0].text


def test_each_stream_adds_up_to_its_generate_stream_and_a_step_shares_a_message(stack: Stack) -> None:
    prompts = {100 + i: dict(text=f"story {i}", max_new_tokens=10, ignore_eos=True) for i in range(16)}
    prompts[200] = dict(text="The cat", max_new_tokens=12, stop=["the"])
    got: dict[int, list[generation_pb2.GenerateStreamResponse]] = {sid: [] for sid in prompts}
    sizes = []
    with Call(stack) as call:
        for sid, fields in prompts.items():
            call.send(start(sid, **fields))
        call.half_close()  # the call ends once every stream has
        for response in call.responses:
            sizes.append(len(response.pieces))
            for piece in response.pieces:
                assert not piece.HasField("error"), piece.error
                got[piece.id].append(piece.message)
    for sid, fields in prompts.items():
        assert joined(got[sid]) == joined(grpc_stream(stack, **fields)), sid
    assert max(sizes) > 1, sizes  # the streams' pieces of a step travel together


def metric(stack: Stack, pattern: str) -> float:
    with urllib.request.urlopen(stack.endpoints()["orchestrator"]["metrics"], timeout=10) as r:
        found = re.search(pattern, r.read().decode(), re.M)
    return float(found[1]) if found else 0.0


RUNNING = r"^moe_lightning_requests_running (\S+)"
CANCELLED = r'^moe_lightning_requests_total\{outcome="cancelled"\} (\S+)'


def test_a_refused_stream_and_a_cancelled_one_leave_the_others_running(stack: Stack) -> None:
    before = metric(stack, CANCELLED)
    pieces: dict[int, list[generation_pb2.StreamPiece]] = {1: [], 2: [], 3: []}
    with Call(stack) as call:
        call.send(start(1, text="x y", max_new_tokens=900, ignore_eos=True))  # to be cancelled
        call.send(start(2, text="x", max_new_tokens=10**6))  # beyond the context: refused
        call.send(start(3, text="a b", max_new_tokens=8, ignore_eos=True))
        reading = iter(call.responses)
        while len(pieces[1]) < 3 or not pieces[2]:
            for p in next(reading).pieces:
                pieces[p.id].append(p)
        call.send(generation_pb2.GenerateStreamsRequest(id=1, cancel=True))
        call.send(start(4, text="again", max_new_tokens=4, ignore_eos=True))  # the call still takes new ones
        pieces[4] = []
        call.half_close()
        for response in reading:
            for p in response.pieces:
                pieces[p.id].append(p)
    assert pieces[2][0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "context" in pieces[2][0].error.message and len(pieces[2]) == 1
    assert not any(p.message.HasField("output") for p in pieces[1])  # it never finished
    for sid, fields in (
        (3, dict(text="a b", max_new_tokens=8, ignore_eos=True)),
        (4, dict(text="again", max_new_tokens=4, ignore_eos=True)),
    ):
        assert joined([p.message for p in pieces[sid]]) == joined(grpc_stream(stack, **fields))
    deadline = time.monotonic() + 30
    while metric(stack, CANCELLED) < before + 1:  # the cancelled stream's request was stopped, its KV freed
        assert time.monotonic() < deadline, "the cancelled stream's request was not cancelled"
        time.sleep(0.2)
    assert metric(stack, RUNNING) == 0


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([start(5, text="a", max_new_tokens=50, ignore_eos=True), start(5, text="b")], "already open"),
        ([generation_pb2.GenerateStreamsRequest(id=6)], "start or cancel"),
    ],
)
def test_a_malformed_request_ends_the_call(stack: Stack, bad: list, message: str) -> None:
    with Call(stack) as call:
        for r in bad:
            call.send(r)
        with pytest.raises(grpc.RpcError) as info:
            for _ in call.responses:
                pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in info.value.details()


def test_leaving_the_call_cancels_its_streams(stack: Stack) -> None:
    before = metric(stack, CANCELLED)
    with Call(stack) as call:
        call.send(start(1, text="x y", max_new_tokens=900, ignore_eos=True))
        next(iter(call.responses))
    deadline = time.monotonic() + 30
    while metric(stack, CANCELLED) < before + 1:
        assert time.monotonic() < deadline, "a stream of a call that went away was not cancelled"
        time.sleep(0.2)


async def _collect(requests: list[generation_pb2.GenerateStreamsRequest], stream: Stream) -> list:
    async def incoming() -> AsyncIterator[generation_pb2.GenerateStreamsRequest]:
        for r in requests:  # no await between them: the loop sees them all before any stream runs
            yield r

    return [r async for r in generate_streams(incoming(), stream, lambda: False)]


def test_large_pieces_are_split_over_responses_each_sendable() -> None:
    async def big(
        request: generation_pb2.GenerateStreamRequest,
    ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        yield generation_pb2.GenerateStreamResponse(text="x" * (MAX_RESPONSE_BYTES // 2))

    responses = asyncio.run(_collect([start(i, text="a") for i in range(5)], big))
    assert sorted(p.id for r in responses for p in r.pieces) == [0, 1, 2, 3, 4]
    assert all(r.ByteSize() <= MAX_RESPONSE_BYTES + 1024 for r in responses) and len(responses) >= 3


def test_a_stream_cancelled_before_it_ran_still_ends_and_so_does_the_call() -> None:
    async def slow(
        request: generation_pb2.GenerateStreamRequest,
    ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        await asyncio.sleep(60)
        yield generation_pb2.GenerateStreamResponse(text="never")

    cancel = generation_pb2.GenerateStreamsRequest(id=1, cancel=True)
    responses = asyncio.run(asyncio.wait_for(_collect([start(1, text="a"), cancel], slow), timeout=10))
    assert responses == []  # nothing for the cancelled stream, and the call ended after the half-close
