"""Expert residency and streaming: the plan respects the budget, the pager serves exact weights."""

from __future__ import annotations

import pytest
import torch

from moe_lightning.weights import ExpertWeights, LayerWeights, ModelWeights
from services.gpu_expert.residency import DeviceBudgetError, ExpertPager, plan_residency

EB, DENSE = 1000, 5000  # bytes of one expert, of the dense weights


def test_everything_resident_when_it_fits() -> None:
    plan = plan_residency(4, 8, EB, DENSE, budget=DENSE + 32 * EB)
    assert all(len(r) == 8 for r in plan.resident) and plan.buffer_slots == 0


@pytest.mark.parametrize("budget_experts", [16, 20, 23, 30])
def test_plan_fits_the_budget_and_spreads_residency(budget_experts: int) -> None:
    budget = DENSE + budget_experts * EB
    plan = plan_residency(4, 8, EB, DENSE, budget)
    assert plan.device_bytes <= budget
    counts = [len(r) for r in plan.resident]
    assert max(counts) - min(counts) <= 1  # even over layers
    assert plan.buffer_slots == 8 - min(counts)
    # one more resident expert per layer would not fit
    assert DENSE + (4 * (min(counts) + 1) + 2 * (plan.buffer_slots - 1)) * EB > budget or min(counts) == 7


def test_hot_experts_stay_resident() -> None:
    hot = [[0, 5, 1, 9], [7, 0, 0, 3], [1, 1, 4, 1]]
    plan = plan_residency(3, 4, EB, DENSE, budget=DENSE + (3 * 1 + 2 * 3) * EB, hot=hot)
    assert plan.resident == ((3,), (0,), (2,))


def test_too_small_a_budget_is_an_error_at_start() -> None:
    with pytest.raises(DeviceBudgetError, match="cannot hold the dense weights"):
        plan_residency(4, 8, EB, DENSE, budget=DENSE + 10 * EB)


def _model(layers: int, experts: int) -> ModelWeights:
    g = torch.Generator().manual_seed(0)
    z = torch.zeros(1)
    return ModelWeights(
        z,
        [
            LayerWeights(
                z,
                z,
                z,
                z,
                z,
                [ExpertWeights(torch.randn(6, 4, generator=g), torch.randn(4, 3, generator=g)) for _ in range(experts)],
            )
            for _ in range(layers)
        ],
        z,
        z,
    )


def test_pager_serves_exact_experts_over_steps_with_an_odd_layer_count() -> None:
    host = _model(3, 5)
    eb = (6 * 4 + 4 * 3) * 4
    plan = plan_residency(3, 5, eb, 0, budget=(3 * 1 + 2 * 4) * eb)
    pager = ExpertPager(host, plan, torch.device("cpu"))
    try:
        assert pager.streams and plan.buffer_slots == 4
        for _ in range(3):  # steps: the buffers alternate in consumption order, not by layer parity
            for layer in range(3):
                got = pager.layer_experts(layer)
                for e, w in enumerate(got):
                    assert torch.equal(w.w13, host.layers[layer].experts[e].w13)
                    assert torch.equal(w.w2, host.layers[layer].experts[e].w2)
        # three steps of 3 layers x 4 streamed experts, plus perhaps the look-ahead copy of the next layer 0
        assert pager.bytes_streamed in (3 * 3 * 4 * eb, (3 * 3 + 1) * 4 * eb)
        hot = plan_residency(3, 5, eb, 0, budget=(3 * 1 + 2 * 4) * eb, hot=[[0, 0, 0, 0, 9]] * 3)
        pager.update_residency(hot)  # expert 4 becomes resident, 0 streams
        assert all(4 in r and 0 not in r for r in pager.resident)
        for layer in range(3):
            for e, w in enumerate(pager.layer_experts(layer)):
                assert torch.equal(w.w13, host.layers[layer].experts[e].w13)
        pager.layer_experts(0)
        pager.reset()  # a failed step: the next starts from layer 0 again
        assert torch.equal(pager.layer_experts(0)[4].w13, host.layers[0].experts[4].w13)
    finally:
        pager.close()
