"""The expert runner and the attention worker wired as the services wire them (real shared-memory
channels, a pager streaming through a ring), for the tests that drive steps by hand; and the tiny
model in an arena buffer, as the weight store lays it out."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from moe_lightning.arena import ArenaLayout, fill_arena
from moe_lightning.handoff import handoff_slot_bytes
from moe_lightning.shm.channel import TensorChannel
from moe_lightning.shm.segment import list_segments, segment_name
from moe_lightning.spec import ModelSpec
from moe_lightning.weights import ModelWeights
from services.cpu_attention.worker import AttentionWorker
from services.gpu_expert.handoff_link import HandoffLink
from services.gpu_expert.pager import ExpertPager
from services.gpu_expert.residency import plan_residency
from services.gpu_expert.runner import ExpertRunner

TOKENS = 256  # tokens a hand-off slot holds


def arena_of(model: Path) -> tuple[ModelSpec, torch.Tensor, ArenaLayout]:
    """`model`'s fp32 weights in an arena buffer."""
    spec = ModelSpec.from_pretrained(model)
    layout = ArenaLayout.for_spec(spec, "float32")
    arena = torch.empty(layout.total_bytes, dtype=torch.uint8)
    fill_arena(arena, layout, model, spec, progress=False)
    return spec, arena, layout


@contextmanager
def wired(
    spec: ModelSpec,
    weights: ModelWeights,
    device: torch.device,
    run: str,
    ring: int,
    slots: int = 2,
    kv_blocks: int = 256,
    lookahead: bool = True,
    **runner: Any,
) -> Iterator[tuple[ExpertRunner, AttentionWorker]]:
    """A runner over `weights` with a ring of `ring` expert slots (nothing resident) and an attention
    worker of `kv_blocks` 4-token blocks, over channels of `slots` slots each; `runner`: more
    ExpertRunner arguments. Every segment of `run` is gone after."""
    worker = AttentionWorker(spec, kv_blocks, 4, run, handoff_slot_bytes(spec, TOKENS, "attn"), slots=slots)
    worker.start()
    out = TensorChannel.create(segment_name(run, "gpu_expert", "qkv"), slots, handoff_slot_bytes(spec, TOKENS, "qkv"))
    expert = weights.layers[0].experts[0]
    expert_bytes = (expert.w13.numel() + expert.w2.numel()) * 4
    residency = plan_residency(spec.num_layers, spec.num_experts, expert_bytes, 0, ring * expert_bytes)
    assert residency.ring_slots == ring and not any(residency.resident)  # every expert streams
    pager = ExpertPager(weights, residency, device, lookahead=lookahead)
    r = ExpertRunner(spec, weights, device, HandoffLink(out, device), pager, **runner)
    r.connect(worker.output.name, session=3)
    worker.connect(out.name, session=3)
    try:
        yield r, worker
    finally:
        pager.close()
        r.link.close()
        worker.stop()
    assert list_segments(run) == []
