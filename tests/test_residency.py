"""Expert residency and streaming: the plan respects the budget, the pager serves exact weights at
micro-batch grain and never overwrites a slot a layer still uses."""

from __future__ import annotations

import pytest
import torch

from moe_lightning.config.checks import DeviceBudgetError
from moe_lightning.timeline import TimelineRecorder
from moe_lightning.weights import ExpertWeights, LayerWeights, ModelWeights
from services.gpu_expert.copy_engine import Pair, ThreadCopyEngine, Ticket
from services.gpu_expert.pager import ExpertPager
from services.gpu_expert.residency import plan_residency

EB, DENSE = 1000, 5000  # bytes of one expert, of the dense weights


def test_everything_resident_when_it_fits() -> None:
    plan = plan_residency(4, 8, EB, DENSE, budget=DENSE + 32 * EB)
    assert all(len(r) == 8 for r in plan.resident) and plan.ring_slots == 0


@pytest.mark.parametrize("budget_experts", [16, 20, 23, 30])
def test_a_double_buffer_first_then_as_many_resident_experts_as_fit(budget_experts: int) -> None:
    budget = DENSE + budget_experts * EB
    plan = plan_residency(4, 8, EB, DENSE, budget)
    assert plan.device_bytes <= budget
    counts = [len(r) for r in plan.resident]
    assert max(counts) - min(counts) <= 1  # even over layers
    assert plan.double_buffered and plan.ring_slots == 2 * (8 - min(counts))
    # one more resident expert per layer would not fit beside a double buffer
    assert DENSE + (4 * (min(counts) + 1) + 2 * (8 - min(counts) - 1)) * EB > budget


@pytest.mark.parametrize("budget_experts", [8, 10, 15])
def test_below_a_double_buffer_a_smaller_ring_still_streams(budget_experts: int) -> None:
    plan = plan_residency(4, 8, EB, DENSE, budget=DENSE + budget_experts * EB)
    assert all(r == () for r in plan.resident)
    assert plan.ring_slots == budget_experts and not plan.double_buffered
    assert plan.max_streamed == 8


def test_without_streaming_all_room_goes_to_residency() -> None:
    plan = plan_residency(4, 8, EB, DENSE, budget=DENSE + 10 * EB, stream=False)
    assert plan.ring_slots == 0 and sorted(len(r) for r in plan.resident) == [2, 2, 3, 3]


def test_hot_experts_stay_resident() -> None:
    hot = [[0, 5, 1, 9], [7, 0, 0, 3], [1, 1, 4, 1]]
    plan = plan_residency(3, 4, EB, DENSE, budget=DENSE + (3 * 1 + 2 * 3) * EB, hot=hot)
    assert plan.resident == ((3,), (0,), (2,))


def test_too_small_a_budget_is_an_error_at_start() -> None:
    with pytest.raises(DeviceBudgetError, match="cannot hold the dense weights .* one layer's streamed experts"):
        plan_residency(4, 8, EB, DENSE, budget=DENSE + 7 * EB)
    with pytest.raises(DeviceBudgetError, match="cannot hold the dense weights"):
        plan_residency(4, 8, EB, DENSE, budget=DENSE - 1, stream=False)


def _model(layers: int, experts: int, dense: tuple[int, ...] = ()) -> ModelWeights:
    g = torch.Generator().manual_seed(0)
    z = torch.zeros(1)

    def layer(i: int) -> LayerWeights:
        n = 0 if i in dense else experts
        pages = [torch.randn(6 * 4 + 4 * 3, generator=g) for _ in range(n)]  # one page per expert, as in the arena
        ids = [ExpertWeights(p[:24].view(6, 4), p[24:].view(4, 3)) for p in pages]
        return LayerWeights(z, z, z, z, None if i in dense else z, ids)

    return ModelWeights(z, [layer(i) for i in range(layers)], z, z)


EXPERT_BYTES = (6 * 4 + 4 * 3) * 4


class RecordingEngine(ThreadCopyEngine):
    """The real thread engine, noting which (layer, pages) each copy job carried and when."""

    def __init__(self) -> None:
        super().__init__(TimelineRecorder(None, "test"))
        self.jobs: list[tuple[int, int]] = []  # (layer, experts in the job)

    def copy(self, pairs: list[Pair], layer: int) -> Ticket:
        self.jobs.append((layer, len(pairs)))  # one transfer per expert: its page
        return super().copy(pairs, layer)


def _assert_exact(host: ModelWeights, layer: int, experts: object) -> None:
    for e in range(len(host.layers[layer].experts)):
        w = experts[e]  # type: ignore[index]
        assert torch.equal(w.w13, host.layers[layer].experts[e].w13)
        assert torch.equal(w.w2, host.layers[layer].experts[e].w2)


def _run_steps(pager: ExpertPager, host: ModelWeights, steps: int, micro_batches: int) -> None:
    """The runner's CGOPipe order: begin layer l, page 0 of l+1, then page m+1 after micro-batch m."""
    layers = len(host.layers)
    for _ in range(steps):
        for layer in range(layers):
            view = pager.begin_layer(layer)
            pager.prefetch_page(layer + 1, 0, micro_batches)
            for m in range(micro_batches):
                _assert_exact(host, layer, view)  # every micro-batch sees the layer's exact experts
                pager.prefetch_page(layer + 1, m + 1, micro_batches)
            pager.end_layer(layer)
        pager.end_step()


@pytest.mark.parametrize("ring", [8, 7, 5])  # a double buffer; one layer plus 2 slots; exactly one layer
def test_pager_serves_exact_experts_at_micro_batch_grain(ring: int) -> None:
    host = _model(3, 5)
    plan = plan_residency(3, 5, EXPERT_BYTES, 0, budget=(3 * 1 + ring) * EXPERT_BYTES)
    if ring < 8:
        plan = plan_residency(3, 5, EXPERT_BYTES, 0, budget=ring * EXPERT_BYTES)  # nothing resident
    engine = RecordingEngine()
    pager = ExpertPager(host, plan, torch.device("cpu"), engine=engine)
    try:
        streamed = plan.max_streamed
        _run_steps(pager, host, steps=3, micro_batches=2)
        # every streamed expert copied once per use, plus the look-ahead of the next step's layer 0
        assert pager.bytes_streamed == (3 * 3 + 1) * streamed * EXPERT_BYTES
        if plan.double_buffered:  # pages go out at micro-batch grain: 2 pages of 2 experts each
            assert engine.jobs[:3] == [(0, 4), (1, 2), (1, 2)]
        else:  # the ring fills what it can during layer l; the rest waits for l's slots
            assert all(n <= ring for _, n in engine.jobs)
    finally:
        pager.close()


def test_a_single_ring_never_overwrites_the_current_layer() -> None:
    host = _model(2, 4)
    plan = plan_residency(2, 4, EXPERT_BYTES, 0, budget=4 * EXPERT_BYTES)
    pager = ExpertPager(host, plan, torch.device("cpu"))
    try:
        view = pager.begin_layer(0)
        for page in range(4):
            pager.prefetch_page(1, page, 4)  # no free slot: queued, not copied over layer 0
        _assert_exact(host, 0, view)
        pager.end_layer(0)  # now layer 1's pages take layer 0's slots
        _assert_exact(host, 1, pager.begin_layer(1))
    finally:
        pager.close()


def test_without_lookahead_a_layer_copies_only_when_it_starts() -> None:
    host = _model(3, 5)
    plan = plan_residency(3, 5, EXPERT_BYTES, 0, budget=(3 * 1 + 8) * EXPERT_BYTES)
    engine = RecordingEngine()
    pager = ExpertPager(host, plan, torch.device("cpu"), lookahead=False, engine=engine)
    try:
        _run_steps(pager, host, steps=2, micro_batches=3)
        assert engine.jobs == [(layer, 4) for _ in range(2) for layer in range(3)]
    finally:
        pager.close()


def test_residency_update_and_reset_keep_experts_exact() -> None:
    host = _model(3, 5)
    budget = (3 * 1 + 8) * EXPERT_BYTES
    pager = ExpertPager(host, plan_residency(3, 5, EXPERT_BYTES, 0, budget), torch.device("cpu"))
    try:
        _run_steps(pager, host, steps=1, micro_batches=2)
        hot = plan_residency(3, 5, EXPERT_BYTES, 0, budget, hot=[[0, 0, 0, 0, 9]] * 3)
        pager.update_residency(hot)  # expert 4 becomes resident, 0 streams
        assert all(4 in r and 0 not in r for r in pager.resident)
        _run_steps(pager, host, steps=1, micro_batches=2)
        pager.begin_layer(0)
        pager.prefetch_page(1, 0, 1)
        pager.reset()  # a failed step: the next starts from layer 0 with an empty ring
        _run_steps(pager, host, steps=1, micro_batches=1)
    finally:
        pager.close()


def test_dense_layers_hold_no_experts_and_residency_spreads_over_the_sparse_ones() -> None:
    plan = plan_residency(5, 4, EB, DENSE, budget=DENSE + (3 * 1 + 6) * EB, dense_layers=(0, 2))
    assert plan.experts_per_layer == (0, 4, 0, 4, 4)
    assert [len(r) for r in plan.resident] == [0, 1, 0, 1, 1]  # r = 1 on each sparse layer
    assert plan.ring_slots == 6 and plan.double_buffered and plan.streamed(0) == []
    assert plan.next_sparse(2) == 3 and plan.next_sparse(5) == 1  # wraps to the next step
    everything = plan_residency(5, 4, EB, DENSE, budget=DENSE + 12 * EB, dense_layers=(0, 2))
    assert everything.ring_slots == 0 and everything.max_streamed == 0  # 3 sparse layers x 4 experts
    host_only = plan_residency(5, 4, EB, DENSE, budget=DENSE + 7 * EB, stream=False, dense_layers=(0, 2))
    assert [len(r) for r in host_only.resident] == [0, 3, 0, 2, 2]


def test_the_pager_prefetches_across_a_dense_layer() -> None:
    """While a dense layer computes, the pages of the next layer with experts are in flight."""
    dense = (1, 2)
    host = _model(5, 5, dense)
    plan = plan_residency(5, 5, EXPERT_BYTES, 0, budget=(3 * 1 + 8) * EXPERT_BYTES, dense_layers=dense)
    assert plan.double_buffered and plan.max_streamed == 4
    engine = RecordingEngine()
    pager = ExpertPager(host, plan, torch.device("cpu"), engine=engine)
    try:
        _run_steps(pager, host, steps=2, micro_batches=2)
        # layer 0's pages at the start, then layer 3's at micro-batch grain while layer 0 computes,
        # layer 4's while layer 3 does; a dense layer never copies
        assert {layer for layer, _ in engine.jobs} == {0, 3, 4}
        assert engine.jobs[:5] == [(0, 4), (3, 2), (3, 2), (4, 2), (4, 2)]
        assert pager.bytes_streamed == (2 * 3 + 1) * 4 * EXPERT_BYTES
        assert len(pager.begin_layer(1)) == 0
    finally:
        pager.close()
