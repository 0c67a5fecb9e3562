"""Loop threads that must not die silently (issue 14, item 8) and a health check that may miss once
(item 14): the scheduler loop survives a planner or batcher fault and, should it die anyway, fails its
waiters and says so; the supervisor ends requests only after consecutive misses or a failed step."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fake_backend import FAKE_KV, FakeBackend, running_scheduler, scheduler_on_fake

from moe_lightning.request import FINISH_LENGTH, GenerationRequest
from moe_lightning.service.errors import ServiceError, UnavailableError, status_for
from orchestrator.scheduler import Scheduler
from orchestrator.supervisor import BackendSupervisor

KV = FAKE_KV


class RaisingPlanner:
    """A planner whose workload feedback raises (its optimize() failing, say)."""

    fixed_batch = fixed_micro_batch = None

    def observe_request(self, prompt_len: int, max_new_tokens: int) -> None:
        raise RuntimeError("optimize() failed")

    def observe_step(self, *args: object) -> None:
        raise RuntimeError("optimize() failed")


@pytest.fixture()
def loop(tiny_model: Path) -> Iterator[tuple[Scheduler, FakeBackend]]:
    with running_scheduler(tiny_model) as pair:
        yield pair


def _request(max_new: int = 4) -> GenerationRequest:
    return GenerationRequest([5, 6, 7], max_new, ignore_eos=True)


def test_a_planner_that_raises_costs_no_request(tiny_model: Path) -> None:
    """It used to kill the scheduler thread at admission: every Generate then waited forever."""
    s, _ = scheduler_on_fake(tiny_model, RaisingPlanner())
    try:
        assert [s.submit(_request()).wait(10).finish_reason for _ in range(3)] == [FINISH_LENGTH] * 3
        assert s.alive
    finally:
        s.stop()


def test_a_batcher_fault_fails_the_requests_with_a_message_and_the_loop_goes_on(
    loop: tuple[Scheduler, FakeBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    s, _ = loop
    real = s.batcher.drop_cancelled
    calls = iter([RuntimeError("bookkeeping bug")])

    def faulty() -> list:
        fault = next(calls, None)
        if fault is not None:
            raise fault
        return real()

    monkeypatch.setattr(s.batcher, "drop_cancelled", faulty)
    with pytest.raises(ServiceError) as info:
        s.submit(_request()).wait(10)
    assert status_for(info.value) == grpc.StatusCode.INTERNAL
    assert "internal error in the scheduler: bookkeeping bug" in str(info.value)
    assert s.alive and s.submit(_request()).wait(10).finish_reason == FINISH_LENGTH  # later requests work
    assert s.stats() == {"waiting": 0, "running": 0, "free_blocks": KV.blocks, "preemptions": 0}


def test_an_admission_fault_returns_the_admitted_blocks(
    loop: tuple[Scheduler, FakeBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batcher's on_admit raising half-way must leave no block counted as used."""
    s, _ = loop
    armed = [True]
    real = s._admitted

    def admitted(seq: object) -> None:
        real(seq)  # type: ignore[arg-type]
        if armed.pop() if armed else False:
            raise KeyError("ticket lookup")

    monkeypatch.setattr(s, "_admitted", admitted)
    with pytest.raises(ServiceError, match="internal error in the scheduler"):
        s.submit(_request()).wait(10)
    assert s.submit(_request()).wait(10).finish_reason == FINISH_LENGTH
    assert s.stats()["free_blocks"] == KV.blocks


def test_a_dead_loop_fails_its_waiters_and_refuses_new_requests(
    loop: tuple[Scheduler, FakeBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    s, backend = loop
    backend.gate.clear()
    backend.entered.clear()
    running = s.submit(_request(50))
    assert backend.entered.wait(10)

    def dies() -> bool:
        raise SystemExit("the guards failed too")

    monkeypatch.setattr(s, "_turn", dies)  # the next turn, after the step in flight
    backend.gate.set()
    with pytest.raises(UnavailableError, match="the scheduler stopped after an internal error"):
        running.wait(10)
    assert not s.alive
    with pytest.raises(UnavailableError, match="cannot run requests"):
        s.submit(_request())


# ---- the supervisor -------------------------------------------------------------------------------


class StubScheduler:
    def __init__(self) -> None:
        self.backend_lost = threading.Event()
        self.alive = True
        self.suspended: list[str] = []
        self.resumed = 0

    def suspend(self, reason: str) -> int:
        self.suspended.append(reason)
        return 1

    def resume(self, kv: object) -> None:
        self.resumed += 1
        self.backend_lost.clear()  # as Scheduler.resume does


class FlakyBackend:
    """unhealthy() answers from a script, then healthy."""

    def __init__(self, script: list[list[str]]) -> None:
        self.script = script
        self.checks = 0

    def unhealthy(self) -> list[str]:
        self.checks += 1
        return self.script.pop(0) if self.script else []

    def connect(self, timeout: float, stop: object) -> object:
        return object()


def _supervise(backend: FlakyBackend, scheduler: StubScheduler, until: float = 0.5) -> list[bool]:
    serving: list[bool] = []
    sup = BackendSupervisor(backend, scheduler, serving.append, lambda c: KV, interval=0.01)  # type: ignore[arg-type]
    sup.start()
    deadline = time.monotonic() + until
    while backend.script and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    sup.stop()
    return serving


def test_one_missed_health_check_ends_no_request() -> None:
    scheduler = StubScheduler()
    backend = FlakyBackend([["cpu_attention"], [], ["gpu_expert"], ["gpu_expert"], []])
    assert _supervise(backend, scheduler) == [] and scheduler.suspended == []
    assert backend.checks > 5


def test_consecutive_misses_or_a_failed_step_end_the_requests() -> None:
    scheduler = StubScheduler()
    _supervise(FlakyBackend([["gpu_expert"]] * 3), scheduler)
    assert scheduler.suspended == ["backend service down: gpu_expert"] and scheduler.resumed == 1
    lost = StubScheduler()
    lost.backend_lost.set()  # a step could not reach a worker: at once, no health check needed
    serving = _supervise(FlakyBackend([]), lost, until=0.05)
    assert lost.suspended == ["backend service down: a step could not reach it"] and serving[:2] == [False, True]


def test_a_dead_scheduler_makes_the_orchestrator_not_serving() -> None:
    scheduler = StubScheduler()
    scheduler.alive = False
    assert _supervise(FlakyBackend([]), scheduler, until=0.05) == [False]


def test_a_failed_step_is_acted_on_at_once_and_stop_does_not_wait_out_the_interval() -> None:
    # the health checks every 30 s here: neither the lost flag nor stop() may wait for the next one
    # (the orchestrator's drain waits on stop(): a SIGTERM must refuse new requests within ~0.1 s)
    scheduler = StubScheduler()
    serving: list[bool] = []
    sup = BackendSupervisor(FlakyBackend([]), scheduler, serving.append, lambda c: KV, interval=30.0)  # type: ignore[arg-type]
    sup.start()
    time.sleep(0.2)
    scheduler.backend_lost.set()
    deadline = time.monotonic() + 2.0
    while scheduler.resumed == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.suspended and serving == [False, True]
    t0 = time.monotonic()
    sup.stop()
    assert time.monotonic() - t0 < 0.5 and not sup._thread.is_alive()
