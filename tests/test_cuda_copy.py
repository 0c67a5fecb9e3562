"""The CUDA copy engine (skipped without a GPU): the arena pinned in place, pages copied on a side
stream, compute ordered after them by events, and slots reused only after their layer's compute."""

from __future__ import annotations

import os

import pytest
import torch

from moe_lightning.shm.segment import Segment
from moe_lightning.weights import ExpertWeights, LayerWeights, ModelWeights
from services.gpu_expert.copy_engine import CudaCopyEngine
from services.gpu_expert.pager import ExpertPager
from services.gpu_expert.pinned import pin_host_memory, unpin_host_memory
from services.gpu_expert.residency import plan_residency

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LAYERS, EXPERTS, D, INTER = 3, 6, 256, 512  # D hidden, INTER expert intermediate


def test_pages_copied_on_a_side_stream_are_exact_through_steps() -> None:
    from moe_lightning.timeline import TimelineRecorder

    per_expert = (2 * INTER * D + D * INTER) * 4
    seg = Segment.create(f"mlt.cudatest.test.{os.getpid()}.arena", LAYERS * EXPERTS * per_expert)
    try:
        arena = seg.bytes()
        device = torch.device("cuda")
        assert pin_host_memory(arena, device)
        g = torch.Generator().manual_seed(0)
        layers = []
        for layer in range(LAYERS):
            experts = []
            for e in range(EXPERTS):
                off = (layer * EXPERTS + e) * per_expert
                w13 = seg.tensor(off, torch.float32, (2 * INTER, D))
                w2 = seg.tensor(off + 2 * INTER * D * 4, torch.float32, (D, INTER))
                w13.copy_(torch.randn(2 * INTER, D, generator=g))
                w2.copy_(torch.randn(D, INTER, generator=g))
                experts.append(ExpertWeights(w13, w2))
            z = torch.zeros(1)
            layers.append(LayerWeights(z, z, z, z, z, experts))
        host = ModelWeights(torch.zeros(1), layers, torch.zeros(1), torch.zeros(1))
        engine = CudaCopyEngine(device, TimelineRecorder(None, "test"))
        plan = plan_residency(LAYERS, EXPERTS, per_expert, 0, budget=(LAYERS + EXPERTS + 1) * per_expert)
        pager = ExpertPager(host, plan, device, engine=engine)
        x = torch.randn(5, D, device=device)
        for _ in range(3):
            for layer in range(LAYERS):
                view = pager.begin_layer(layer)
                pager.prefetch_page(layer + 1, 0, 2)
                for m in range(2):
                    for e in range(EXPERTS):  # compute on the default stream right after the wait
                        want = x @ host.layers[layer].experts[e].w13.to(device).T
                        torch.testing.assert_close(x @ view[e].w13.T, want)
                    pager.prefetch_page(layer + 1, m + 1, 2)
                pager.end_layer(layer)
            pager.end_step()
        pager.close()
        unpin_host_memory(arena, device)
    finally:
        seg.close()
        seg.unlink()
