"""The scheduler loop around the batcher, with a fake backend in its place: waiters get their
results, a failed step fails only its requests, a lost backend suspends and resumes, cancellation
and shutdown end what is in flight (real threads, no processes)."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fake_backend import FAKE_KV, FakeBackend, running_scheduler

from moe_lightning.request import FINISH_LENGTH, GenerationRequest
from moe_lightning.service.errors import ServiceError, UnavailableError, status_for
from moe_lightning.step_protocol import StepKind
from orchestrator.backend import KVCapacity
from orchestrator.scheduler import Scheduler

KV = FAKE_KV


@pytest.fixture()
def loop(tiny_model: Path) -> Iterator[tuple[Scheduler, FakeBackend]]:
    with running_scheduler(tiny_model) as pair:
        yield pair


def _request(max_new: int = 4) -> GenerationRequest:
    return GenerationRequest([5, 6, 7], max_new, ignore_eos=True)


def test_requests_finish_and_stream_their_tokens(loop: tuple[Scheduler, FakeBackend]) -> None:
    s, backend = loop
    sink: queue.Queue[list[int]] = queue.Queue()  # what a stream would send: the tokens, as they come
    streamed = s.submit(_request(5), lambda tokens, logprobs, text: sink.put(tokens))
    others = [s.submit(_request(3 + i)) for i in range(20)]
    results = [t.wait(30) for t in (streamed, *others)]
    assert [len(r.token_ids) for r in results] == [5, *[3 + i for i in range(20)]]
    assert all(r.finish_reason == FINISH_LENGTH for r in results)
    tokens = []
    while not sink.empty():
        tokens += sink.get()
    assert tokens == results[0].token_ids
    assert backend.plans[0].kind is StepKind.PREFILL
    assert s.stats() == {"waiting": 0, "running": 0, "free_blocks": KV.blocks, "preemptions": 0}
    released = sorted(i for p in backend.plans for i in p.release)
    assert released == sorted(t.seq.seq_id for t in (streamed, *others))  # every finish reached the workers


def test_a_failed_step_fails_its_requests_and_the_loop_goes_on(loop: tuple[Scheduler, FakeBackend]) -> None:
    s, backend = loop
    backend.fail = ServiceError("attention failed: boom", grpc.StatusCode.INTERNAL)
    first = s.submit(_request())
    with pytest.raises(ServiceError, match="boom"):
        first.wait(30)
    assert not s.backend_lost.is_set()  # not a lost service: no recovery
    assert s.submit(_request()).wait(30).finish_reason == FINISH_LENGTH
    assert s.stats()["free_blocks"] == KV.blocks


def test_a_lost_backend_flags_recovery_and_suspend_resume_start_a_new_session(
    loop: tuple[Scheduler, FakeBackend],
) -> None:
    s, backend = loop
    backend.down = UnavailableError("gpu_expert is unreachable")
    with pytest.raises(UnavailableError):
        s.submit(_request()).wait(30)
    assert s.backend_lost.wait(5)
    # no step until the supervisor acts: every one would fail at once (the failed step's releases
    # went with the next plan, thousands of steps a second), and new requests are refused at once
    steps = len(backend.plans)
    with pytest.raises(UnavailableError, match="recovering; retry shortly"):
        s.submit(_request())
    time.sleep(0.5)
    assert len(backend.plans) == steps
    assert s.suspend("backend service down: gpu_expert") == 0
    with pytest.raises(UnavailableError, match="retry shortly"):
        s.submit(_request())
    backend.down = None
    s.resume(KVCapacity(128, 4, "float32"))
    assert not s.backend_lost.is_set() and s.kv_blocks == 128
    assert s.submit(_request()).wait(30).finish_reason == FINISH_LENGTH
    # a suspend while a step is in flight ends its requests; the step's late answer is dropped
    backend.gate.clear()
    backend.entered.clear()
    running = s.submit(_request(50))
    assert backend.entered.wait(10)
    assert s.suspend("backend service down: cpu_attention") == 1
    with pytest.raises(UnavailableError, match="retry it"):
        running.wait(5)
    backend.gate.set()
    s.resume(KVCapacity(128, 4, "float32"))
    assert s.submit(_request()).wait(30).finish_reason == FINISH_LENGTH
    assert s.stats()["free_blocks"] == 128


def test_cancel_and_shutdown_end_what_is_in_flight(loop: tuple[Scheduler, FakeBackend]) -> None:
    s, backend = loop
    long = s.submit(_request(500))
    s.cancel(long)
    with pytest.raises(ServiceError) as info:
        long.wait(30)
    assert status_for(info.value) == grpc.StatusCode.CANCELLED
    backend.gate.clear()
    backend.entered.clear()
    pending = [s.submit(_request(100)) for _ in range(3)]
    assert backend.entered.wait(10)
    backend.gate.set()
    s.stop(drain_timeout=0.0)
    for t in pending:
        with pytest.raises(ServiceError, match="shut down"):
            t.wait(5)
