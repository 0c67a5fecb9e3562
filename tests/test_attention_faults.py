"""The attention loop answers a hand-off whose handling raised anything with an INTERNAL error and
keeps serving (issue 14, item 8: it caught a few exception types, and any other ended the thread, so
gpu_expert waited for answers that never came). A real runner and worker, as in test_pipeline.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from runner_pair import arena_of, wired

import services.cpu_attention.worker as worker_module
from moe_lightning.arena import weights_from_arena
from moe_lightning.sampling import SamplingParams
from moe_lightning.service.errors import ServiceError, status_for
from moe_lightning.step_protocol import SequenceWork, StepKind, StepPlan
from services.cpu_attention.worker import AttentionWorker
from services.gpu_expert.runner import ExpertRunner


@pytest.fixture()
def pair(tiny_model: Path) -> Iterator[tuple[ExpertRunner, AttentionWorker]]:
    spec, arena, layout = arena_of(tiny_model)
    device = torch.device("cpu")
    weights = weights_from_arena(arena, layout, spec, device, experts_on_host=True)
    run = f"attnfault{os.getpid()}"
    with wired(spec, weights, device, run, spec.num_experts, lookahead=False, overlap=False) as wired_pair:
        yield wired_pair


def _prefill(step: int, first_seq: int) -> StepPlan:
    works = [SequenceWork(first_seq + i, [5 + i, 7, 9], 0, SamplingParams()) for i in range(2)]
    return StepPlan(step, [works], StepKind.PREFILL)


def _once(real: object, error: Exception) -> object:
    """`real`, except that its first call raises `error`."""
    armed = [error]

    def call(*args: object, **kwargs: object) -> object:
        if armed:
            raise armed.pop()
        return real(*args, **kwargs)  # type: ignore[operator]

    return call


@pytest.mark.parametrize(
    "target",
    ["attend", "decode_expert_message"],  # inside _handle's try, and before it (the message itself)
)
def test_an_unexpected_exception_is_answered_as_internal_and_the_loop_serves_on(
    pair: tuple[ExpertRunner, AttentionWorker], monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    runner, worker = pair
    monkeypatch.setattr(worker_module, target, _once(getattr(worker_module, target), RuntimeError("kaboom")))
    with pytest.raises(ServiceError) as info:
        runner.step(_prefill(1, 0))
    assert status_for(info.value) == grpc.StatusCode.INTERNAL
    assert "internal error in attention" in str(info.value) and "kaboom" in str(info.value)
    assert worker._thread.is_alive()
    out = runner.step(_prefill(2, 10))  # the next step is served as if nothing happened
    assert out.seq_ids == [10, 11] and len(out.token_ids) == 2
