from __future__ import annotations

import pytest
import torch

from moe_lightning.sampling import SamplingParams, sample

LOGITS = torch.tensor([[0.1, 2.0, 1.9, -1.0, 0.5], [3.0, 0.0, 0.0, 0.0, 2.9]])


def test_greedy_and_degenerate_filters_pick_the_argmax() -> None:
    greedy = SamplingParams()
    assert sample(LOGITS, [greedy, greedy], [None, None]).tolist() == [1, 0]
    for p in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=5.0, top_p=1e-6, seed=1)):
        for _ in range(20):
            assert sample(LOGITS, [p, p], [p.make_generator(), p.make_generator()]).tolist() == [1, 0]


def test_seeded_sampling_is_reproducible_and_seeds_differ() -> None:
    p = SamplingParams(temperature=1.5, seed=1234)
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))

    def draw(params: SamplingParams) -> list[int]:
        gen = params.make_generator()
        return [int(sample(logits, [params], [gen])[0]) for _ in range(30)]

    assert draw(p) == draw(p)
    assert draw(p) != draw(SamplingParams(temperature=1.5, seed=4321))


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    pk = SamplingParams(temperature=1.0, top_k=2, seed=0)
    gk = pk.make_generator()
    assert {int(sample(logits, [pk], [gk])[0]) for _ in range(300)} == {0, 1}
    pp = SamplingParams(temperature=1.0, top_p=0.85, seed=0)  # 0.5 + 0.3 < 0.85 -> token 2 also kept
    gp = pp.make_generator()
    assert {int(sample(logits, [pp], [gp])[0]) for _ in range(500)} == {0, 1, 2}


def test_temperature_changes_the_distribution() -> None:
    logits = torch.tensor([[1.0, 0.0]])
    cold, hot = SamplingParams(temperature=0.2, seed=0), SamplingParams(temperature=5.0, seed=0)
    gc, gh = cold.make_generator(), hot.make_generator()
    n = 2000
    cold_zero = sum(int(sample(logits, [cold], [gc])[0] == 0) for _ in range(n)) / n
    hot_zero = sum(int(sample(logits, [hot], [gh])[0] == 0) for _ in range(n)) / n
    assert cold_zero > 0.97  # sigmoid(5) = 0.993
    assert 0.5 < hot_zero < 0.61  # sigmoid(0.2) = 0.55


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be"),
        ({"temperature": float("nan")}, "temperature must be"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_invalid_parameters_say_what_is_allowed(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
