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

import services.cpu_attention.worker as worker_module
from moe_lightning.arena import ArenaLayout, fill_arena, weights_from_arena
from moe_lightning.handoff import handoff_slot_bytes
from moe_lightning.sampling import SamplingParams
from moe_lightning.service.errors import ServiceError, status_for
from moe_lightning.shm.channel import TensorChannel
from moe_lightning.shm.segment import list_segments, segment_name
from moe_lightning.spec import ModelSpec
from moe_lightning.step_protocol import SequenceWork, StepKind, StepPlan
from services.cpu_attention.worker import AttentionWorker
from services.gpu_expert.handoff_link import HandoffLink
from services.gpu_expert.pager import ExpertPager
from services.gpu_expert.residency import plan_residency
from services.gpu_expert.runner import ExpertRunner


@pytest.fixture()
def pair(tiny_model: Path) -> Iterator[tuple[ExpertRunner, AttentionWorker]]:
    spec = ModelSpec.from_pretrained(tiny_model)
    layout = ArenaLayout.for_spec(spec, "float32")
    arena = torch.empty(layout.total_bytes, dtype=torch.uint8)
    fill_arena(arena, layout, tiny_model, spec, progress=False)
    device = torch.device("cpu")
    weights = weights_from_arena(arena, layout, spec, device, experts_on_host=True)
    run = f"attnfault{os.getpid()}"
    worker = AttentionWorker(spec, 256, 4, run, handoff_slot_bytes(spec, 256, "attn"), slots=2)
    worker.start()
    out = TensorChannel.create(segment_name(run, "gpu_expert", "qkv"), 2, handoff_slot_bytes(spec, 256, "qkv"))
    expert_bytes = sum(t.numel() * 4 for t in (weights.layers[0].experts[0].w13, weights.layers[0].experts[0].w2))
    residency = plan_residency(spec.num_layers, spec.num_experts, expert_bytes, 0, spec.num_experts * expert_bytes)
    pager = ExpertPager(weights, residency, device, lookahead=False)
    runner = ExpertRunner(spec, weights, device, HandoffLink(out, device), pager, overlap=False)
    runner.connect(worker.output.name, session=3)
    worker.connect(out.name, session=3)
    yield runner, worker
    pager.close()
    runner.link.close()
    worker.stop()
    assert list_segments(run) == []


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
