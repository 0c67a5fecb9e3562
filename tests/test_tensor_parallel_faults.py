"""A tensor-parallel rank that dies or hangs, with the launcher supervising (as `up --gpus 2` does):
the group ends as a whole (rank 0 exits, taking the others), requests in flight end UNAVAILABLE, the
orchestrator goes NOT_SERVING, rank 0 is restarted and forms a new group through a new rendezvous,
the stack re-wires and answers exactly as before; a hung rank is found by a collective's timeout,
never waited for forever (docs/parallel.md)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.launcher import Stack, StackError
from moe_lightning.spec import ModelSpec

from processes import in_flight, ranks_of, wait_for_ranks, wait_serving, watch_health
from reference import E2E_PROMPTS as PROMPTS
from tp_configs import rank_device_budget


@pytest.fixture(scope="module")
def supervised(make_module_stack: Callable[..., Stack], tmp_path_factory: pytest.TempPathFactory) -> Stack:
    s = make_module_stack(
        gpus=2,
        cache_dir=tmp_path_factory.mktemp("arena-cache"),
        extra={"gpu_expert": ["--tp-timeout", "4"]},  # a hung rank is a broken group after 4 s
    )
    s.supervise()
    return s


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_failed_rank_restarts_the_group_and_it_answers_exactly(
    supervised: Stack, fault: str, reference: dict
) -> None:
    wait_serving(supervised.api_address, 90)
    rank0 = supervised.procs["gpu_expert"].pid
    (rank1,) = wait_for_ranks(rank0, 1)
    restarts_before = len(supervised.restarts["gpu_expert"])
    threads, results = in_flight(supervised, 4)
    time.sleep(1.0)  # the batch is decoding
    assert not results, "the requests finished before the fault: make them longer"
    faulted_at = time.monotonic()
    os.kill(rank1, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    health = watch_health(supervised.api_address, 15.0)
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 4 and all(not t.is_alive() for t in threads), "a request hung"
    limit = 5.0 if fault == "killed" else 4.0 + 3.0  # the collective's timeout (4 s), then the step fails
    for ended, r in results:
        assert isinstance(r, grpc.RpcError) and r.code() == grpc.StatusCode.UNAVAILABLE, r
        assert ended - faulted_at < limit, f"ended {ended - faulted_at:.1f} s after the fault"
    assert health_pb2.HealthCheckResponse.NOT_SERVING in health, health
    wait_serving(supervised.api_address, 120)
    assert len(supervised.restarts["gpu_expert"]) == restarts_before + 1  # rank 0, which leads the group
    new_rank0 = supervised.procs["gpu_expert"].pid
    assert new_rank0 != rank0 and wait_for_ranks(new_rank0, 1) != [rank1]
    with GenerationClient(supervised.api_address, timeout=60) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=14) for p in PROMPTS])
    assert [d.token_ids for d in done] == [reference[i] for i in range(len(PROMPTS))]
    with pytest.raises(ProcessLookupError):  # the old rank is gone, even the stopped one
        for _ in range(100):
            os.kill(rank1, 0)
            time.sleep(0.1)


def test_a_rank_that_dies_during_start_up_ends_the_start_at_once_with_the_reason(
    make_stack: Callable[..., Stack],
) -> None:
    """Rank 0 waits for the others in collectives that only give up after --tp-startup-timeout (15
    minutes): a rank that exits before the group is ready must end rank 0 at once, saying which."""
    s = make_stack(start=False, gpus=2)
    failure: list[BaseException] = []

    def start() -> None:
        try:
            s.start(timeout=120)
        except BaseException as exc:
            failure.append(exc)

    starting = threading.Thread(target=start)
    starting.start()
    deadline = time.monotonic() + 60
    rank1 = None
    while rank1 is None and starting.is_alive():
        assert time.monotonic() < deadline, "rank 1 never started"
        proc = s.procs.get("gpu_expert")
        try:
            found = ranks_of(proc.pid) if proc is not None else []
        except OSError:  # a thread of rank 0 ended while its children were read
            found = []
        rank1 = found[0] if found else None
        time.sleep(0.02)
    assert rank1 is not None, failure
    os.kill(rank1, signal.SIGKILL)
    killed_at = time.monotonic()
    starting.join(timeout=120)
    assert not starting.is_alive()
    assert failure and isinstance(failure[0], StackError), failure
    assert time.monotonic() - killed_at < 15, "rank 0 waited for the dead rank"
    assert "gpu_expert exited with code 1" in str(failure[0])
    assert "rank 1 of 2 exited with code -9 during start-up" in str(failure[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_two_ranks_on_one_gpu_stream_their_slices_and_come_back_after_a_kill(
    make_stack: Callable[..., Stack], hf_dir: Path, reference: dict
) -> None:
    """The GPU check's: NCCL refuses two ranks on one device, so gloo over CUDA tensors, each rank
    streaming its slices through its own pinned buffers; then a rank killed between steps."""
    spec = ModelSpec.from_pretrained(hf_dir)
    s = make_stack(
        device="cuda",
        dtype="float32",
        gpus=2,
        experts_placement="gpu",
        micro_batch_size=3,
        device_memory=str(rank_device_budget(hf_dir, 2, spec.num_experts + 1)),
        extra={"gpu_expert": ["--tp-backend", "gloo", "--tp-same-device", "--tp-timeout", "10"]},
    )
    s.supervise()
    for attempt in range(2):
        with GenerationClient(s.api_address, timeout=120) as c:
            done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=14) for p in PROMPTS])
        assert [d.token_ids for d in done] == [reference[i] for i in range(len(PROMPTS))], attempt
        with urllib.request.urlopen(s.endpoints()["gpu_expert"]["metrics"], timeout=10) as r:
            text = r.read().decode()
        streamed = re.findall(r'^moe_lightning_rank_expert_bytes_streamed_total\{rank="(\d)"\} (\S+)', text, re.M)
        assert len(streamed) == 2 and all(float(v) > 0 for _, v in streamed), streamed
        assert float(re.search(r"^moe_lightning_pinned_host_bytes (\S+)", text, re.M)[1]) > 0
        if attempt == 0:
            (rank1,) = wait_for_ranks(s.procs["gpu_expert"].pid, 1)
            os.kill(rank1, signal.SIGKILL)
            time.sleep(2.0)  # the leader's watch notices within 0.5 s and the group ends
            wait_serving(s.api_address, 180)
