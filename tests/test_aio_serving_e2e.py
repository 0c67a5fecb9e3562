"""Issue 14, item 5: long requests must not starve everything else. With the API on grpc.aio a waiting
call holds no thread: 32 long streams open at once (twice the 16 threads that used to serve every call)
leave health, metadata and new calls answering within a second, and --max-queue, not a thread count,
is what refuses work."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

from moe_lightning.api.generation.v1 import generation_pb2, generation_pb2_grpc
from moe_lightning.client import Prompt
from moe_lightning.launcher import Stack
from moe_lightning.service.names import GENERATION as API
from moe_lightning.service.upstream import health_status, open_channel

from reference import E2E_PROMPTS as PROMPTS

STREAMS, MAX_QUEUE = 32, 16


def test_32_long_streams_leave_health_and_new_calls_answering(make_stack: Callable[..., Stack]) -> None:
    # --rpc-threads 16 was the threaded server's pool: with it, 16 streams took every thread
    s = make_stack(extra={"orchestrator": ["--rpc-threads", "16", "--max-queue", str(MAX_QUEUE)]})
    ch = open_channel(s.api_address)
    stub = generation_pb2_grpc.GenerationStub(ch)
    long = generation_pb2.GenerateStreamRequest(
        input=Prompt(token_ids=PROMPTS[1], max_new_tokens=400, ignore_eos=True).to_pb()
    )
    streams = [stub.GenerateStream(long, timeout=300) for _ in range(STREAMS)]
    first: list[object] = [None] * STREAMS
    extra: list[grpc.Future] = []

    def read_first(i: int) -> None:  # a token, or the refusal of a full queue
        try:
            first[i] = next(streams[i])
        except grpc.RpcError as exc:
            first[i] = exc.code()

    readers = [threading.Thread(target=read_first, args=(i,)) for i in range(STREAMS)]
    try:
        for r in readers:
            r.start()
        deadline = time.monotonic() + 120  # the running ones stream, the refused are told; the rest wait
        while sum(f is not None for f in first) < STREAMS - MAX_QUEUE and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)
        refused = [f for f in first if isinstance(f, grpc.StatusCode)]
        assert set(refused) <= {grpc.StatusCode.RESOURCE_EXHAUSTED}, refused
        assert len(refused) >= STREAMS - MAX_QUEUE - 8  # 8: the stack's batch; the rest must wait or be refused
        open_now = STREAMS - len(refused)
        assert open_now >= MAX_QUEUE
        for _ in range(5):  # while they all hold their calls open
            t0 = time.monotonic()
            assert health_status(ch, API, timeout=1.0) == 1
            stub.GetServerMetadata(generation_pb2.GetServerMetadataRequest(), timeout=1.0)
            assert time.monotonic() - t0 < 1.0
            time.sleep(0.2)
        # new calls are queued, or refused once --max-queue is reached, at once: never left waiting for
        # a thread. More at once than the queue holds: some must be refused, within a second.
        t0 = time.monotonic()
        extra += [
            stub.Generate.future(generation_pb2.GenerateRequest(input=long.input), timeout=300)
            for _ in range(MAX_QUEUE + 8)
        ]
        while time.monotonic() - t0 < 1.0 and not any(c.done() for c in extra):
            time.sleep(0.01)
        done = [c for c in extra if c.done()]
        assert done, "no new call was answered within 1 s: they wait for a thread, not in the queue"
        for c in done:
            error = c.exception()
            assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
            assert "queue is full (16)" in error.details()
    finally:
        for st in [*streams, *extra]:
            st.cancel()
        for r in readers:
            r.join(10)
    # cancelled streams free their places: a short request runs to the end
    deadline = time.monotonic() + 60
    while True:
        try:
            out = stub.Generate(
                generation_pb2.GenerateRequest(input=Prompt(token_ids=PROMPTS[0], max_new_tokens=3).to_pb()),
                timeout=60,
            )
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
            time.sleep(0.5)
    assert len(out.output.token_ids) == 3
    ch.close()
