"""experts_forward (moe_lightning/stages/moe.py): each token's top-k experts weighted and summed, only
the experts that got tokens touched, the tokens per expert counted, at a decode step's shape."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from moe_lightning.stages.moe import expert_ffn, experts_forward
from moe_lightning.weights import ExpertWeights

D, FFN, E, A = 64, 96, 8, 2  # hidden, expert intermediate, experts, experts per token


def _experts(seed: int) -> list[ExpertWeights]:
    g = torch.Generator().manual_seed(seed)
    return [
        ExpertWeights(torch.randn(2 * FFN, D, generator=g) * 0.1, torch.randn(D, FFN, generator=g) * 0.1)
        for _ in range(E)
    ]


class _OnlyThese(Sequence[ExpertWeights]):
    """Experts a caller fetches on demand: touching one that got no tokens is an error."""

    def __init__(self, experts: list[ExpertWeights], used: set[int]) -> None:
        self.experts, self.used = experts, used

    def __len__(self) -> int:
        return len(self.experts)

    def __getitem__(self, e):  # type: ignore[override]
        assert e in self.used, f"expert {e} got no tokens and was fetched"
        return self.experts[e]


@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_each_token_is_the_weighted_sum_of_its_experts(tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    experts = _experts(tokens)
    x = torch.randn(tokens, D, generator=g)
    ids = torch.stack([torch.randperm(E - 2, generator=g)[:A] for _ in range(tokens)])  # experts 6, 7 idle
    weights = torch.softmax(torch.randn(tokens, A, generator=g), dim=-1)
    out, counts = experts_forward(x, weights, ids, _OnlyThese(experts, set(ids.unique().tolist())))
    want = torch.zeros(tokens, D)
    for t in range(tokens):
        for a in range(A):
            want[t] += weights[t, a] * expert_ffn(experts[int(ids[t, a])], x[t : t + 1])[0]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert counts.tolist() == torch.bincount(ids.reshape(-1), minlength=E).tolist()
    assert counts[E - 2 :].tolist() == [0, 0]


def test_the_sum_is_in_fp32_and_rounded_once_for_a_bf16_model() -> None:
    """As transformers' grouped experts path: each expert's rows weighted in fp32, added up in fp32 in
    expert order, rounded to bf16 once (a bf16 sum per expert rounds about half the outputs otherwise)."""
    experts = [ExpertWeights(e.w13.bfloat16(), e.w2.bfloat16()) for e in _experts(3)]
    x = torch.randn(16, D).bfloat16()
    ids = torch.tensor([[t % E, (t + 3) % E] for t in range(16)])
    weights = torch.softmax(torch.randn(16, A), dim=-1)
    out, _ = experts_forward(x, weights, ids, experts)
    fp32 = torch.zeros(16, D)
    rounded_each_time = torch.zeros(16, D, dtype=torch.bfloat16)
    for e in range(E):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        y = expert_ffn(experts[e], x[rows]).float() * weights[rows, slots, None]
        fp32.index_add_(0, rows, y)
        rounded_each_time.index_add_(0, rows, y.bfloat16())
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, fp32.bfloat16())
    assert not torch.equal(out, rounded_each_time)  # the case this guards against differs here
