"""kill -9 of each service during a batch, with the launcher supervising (as `up` does): nothing
hangs, requests in flight end with UNAVAILABLE within 5 s (or finish, when only the weight store
died: the workers keep its mapped weights), the orchestrator goes NOT_SERVING and back to SERVING,
the dead service is restarted, the stack answers exactly as before, and no segment leaks."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.launcher import Stack
from moe_lightning.service.upstream import open_channel
from moe_lightning.shm.segment import list_segments, pid_alive

from processes import in_flight, wait_serving, watch_health
from reference import E2E_PROMPTS as PROMPTS

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def supervised(make_module_stack: Callable[..., Stack], tmp_path_factory: pytest.TempPathFactory) -> Stack:
    # the weight store's restart maps the arena cache
    s = make_module_stack(cache_dir=tmp_path_factory.mktemp("arena-cache"))
    s.supervise()
    return s


@pytest.mark.parametrize("victim", ["gpu_expert", "cpu_attention", "weight_store", "orchestrator"])
def test_a_killed_service_comes_back_and_answers_exactly(supervised: Stack, victim: str, reference: dict) -> None:
    wait_serving(supervised.api_address, 60)
    restarts_before = len(supervised.restarts[victim])
    threads, results = in_flight(supervised, 4)
    time.sleep(1.0)  # the batch is decoding
    assert not results, "the requests finished before the fault: make them longer"
    killed_at = time.monotonic()
    os.kill(supervised.procs[victim].pid, signal.SIGKILL)
    # as long as a request may take to fail (5 s, below): a dead worker is found by a step's peer
    # heartbeat or by three missed health checks, whichever comes first, 1.5-4.5 s after the kill
    health = [] if victim == "orchestrator" else watch_health(supervised.api_address, 10.0)
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 4 and all(not t.is_alive() for t in threads), "a request hung"
    if victim == "weight_store":  # the workers still have the weights mapped: the batch finishes
        assert all(not isinstance(r, Exception) for _, r in results), results
    else:
        for ended, r in results:
            assert isinstance(r, grpc.RpcError) and r.code() == grpc.StatusCode.UNAVAILABLE, r
            assert ended - killed_at < 5.0, f"ended {ended - killed_at:.1f} s after the kill"
    # A restarted weight store serves again from its arena copy within ~0.5 s, often before the
    # orchestrator's three missed checks count it down: its death need not show (the batch goes on
    # either way). A store that stays unanswering does degrade the stack: the frozen-store test below.
    if victim not in ("orchestrator", "weight_store"):
        assert health_pb2.HealthCheckResponse.NOT_SERVING in health, health
    wait_serving(supervised.api_address, 90)
    assert len(supervised.restarts[victim]) == restarts_before + 1
    with GenerationClient(supervised.api_address, timeout=60) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=14) for p in PROMPTS])
    assert [d.token_ids for d in done] == [reference[i] for i in range(len(PROMPTS))]
    # the dead incarnation's segments were swept by its successor: every segment has a live owner
    for name in list_segments(supervised.config.run_id):
        owner_pid = re.match(r"^(?:sem\.)?mlt\.[\w-]+\.[\w-]+\.(\d+)\.", name)
        assert owner_pid and pid_alive(int(owner_pid[1])), name
    if victim == "weight_store":
        from moe_lightning.api.weight_store.v1 import weight_store_pb2, weight_store_pb2_grpc

        ch = open_channel(supervised.addresses["weight_store"])
        manifest = weight_store_pb2_grpc.WeightStoreStub(ch).GetManifest(weight_store_pb2.GetManifestRequest())
        ch.close()
        # took over the arena gpu_expert still maps: one copy of the weights in host memory, no load
        assert manifest.adopted
        assert [n for n in list_segments(supervised.config.run_id) if n.endswith(".arena")] == [
            manifest.region.lstrip("/")
        ]


def test_a_frozen_weight_store_degrades_the_stack_until_it_answers(supervised: Stack) -> None:
    """A weight store that stops answering (SIGSTOP: alive, so not restarted) is down after three
    missed health checks: the orchestrator goes NOT_SERVING while the requests in flight finish on the
    weights the workers map, and is SERVING again once the store answers."""
    wait_serving(supervised.api_address, 60)
    restarts_before = len(supervised.restarts["weight_store"])
    threads, results = in_flight(supervised, 4)
    time.sleep(1.0)  # the batch is decoding
    assert not results, "the requests finished before the fault: make them longer"
    pid = supervised.procs["weight_store"].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        health = watch_health(supervised.api_address, 10.0)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert health_pb2.HealthCheckResponse.NOT_SERVING in health, health
    wait_serving(supervised.api_address, 30)
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 4 and all(not t.is_alive() for t in threads), "a request hung"
    assert all(not isinstance(r, Exception) and r.completion_tokens == 400 for _, r in results), results
    assert len(supervised.restarts["weight_store"]) == restarts_before and supervised.procs["weight_store"].pid == pid


def test_sigterm_on_the_orchestrator_drains_in_flight_requests(
    make_stack: Callable[..., Stack], reference: dict
) -> None:
    s = make_stack(kv_cache_memory="16MiB", extra={"orchestrator": ["--drain-seconds", "30"]})
    results: list = []

    def one(i: int) -> None:
        try:
            with GenerationClient(s.api_address, timeout=60) as c:
                out = c.generate(Prompt(token_ids=PROMPTS[i], max_new_tokens=300, ignore_eos=True))
                results.append((i, out))
        except grpc.RpcError as exc:
            results.append((i, exc))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # decoding
    assert not results
    s.procs["orchestrator"].send_signal(signal.SIGTERM)
    time.sleep(0.2)
    with GenerationClient(s.api_address, timeout=10) as c, pytest.raises(grpc.RpcError) as info:
        c.generate(Prompt(token_ids=PROMPTS[0], max_new_tokens=3))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # stopped accepting
    for t in threads:
        t.join(60)
    assert s.procs["orchestrator"].wait(30) == 0
    s.stop()
    assert sorted(i for i, _ in results) == [0, 1, 2, 3]
    for i, r in results:  # in flight when the signal came: finished, not cut off
        assert not isinstance(r, Exception), r
        assert len(r.token_ids) == 300 and r.token_ids[: len(reference[i])] == reference[i]
    assert s.leaked_segments() == []
