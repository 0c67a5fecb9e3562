from __future__ import annotations

import pytest
import torch

from moe_lightning.exponential_race import draw_seed
from moe_lightning.quant import host_kernels
from moe_lightning.sampling import NOT_FINITE, SamplingParams, SequenceSampler, greedy_tokens, sample

LOGITS = torch.tensor([[0.1, 2.0, 1.9, -1.0, 0.5], [3.0, 0.0, 0.0, 0.0, 2.9]])


def keys(seed: int, n: int) -> list[int]:
    """The keys of a stream's first n draws, as SequenceSampler.next_key gives them."""
    return [draw_seed(seed, i) for i in range(n)]


def test_greedy_and_degenerate_filters_pick_the_argmax() -> None:
    greedy = SamplingParams()
    assert sample(LOGITS, [greedy, greedy], [None, None]).tolist() == [1, 0]
    degenerate = (
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=5.0, top_p=1e-6, seed=1),
        SamplingParams(temperature=1e-300, seed=1),  # below fp32's range: no NaN, the maximum
        SamplingParams(temperature=1e-30, top_k=3, top_p=0.5, seed=1),
    )
    for p in degenerate:
        for k in keys(7, 20):
            assert sample(LOGITS, [p, p], [k, k]).tolist() == [1, 0]


def greedy_cases() -> list[torch.Tensor]:
    """(B, V) logits in every layout the head leaves: rows (the `matmul` GEMM), a (V, B) tensor's
    transposed view (`weight_major`), a strided slice of either, one row; with repeated maxima and NaN."""
    g = torch.Generator().manual_seed(3)
    by_columns = torch.randn(32000, 64, generator=g)
    by_columns[[9, 31000], 5] = 50.0  # the first of two maxima wins
    by_columns[[400, 20], 6] = float("nan")  # a NaN is the maximum, the first of them
    rows = torch.randn(256, 32000, generator=g)
    rows[3, [7, 8]] = 50.0
    rows[4, 17] = float("nan")
    return [by_columns.T, rows, by_columns.T[::2], rows[:, ::3], rows[:1], by_columns[:1000, :3].T.contiguous()]


@pytest.mark.parametrize("native", [True, False], ids=["native", "without-the-extension"])
def test_greedy_tokens_equal_torch_argmax_in_every_layout(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if native and not host_kernels.available():
        pytest.skip("the native host kernels are not built here")
    if not native:
        monkeypatch.setattr(host_kernels, "extension", lambda: None)
    for logits in greedy_cases():
        assert torch.equal(greedy_tokens(logits), torch.argmax(logits, dim=-1)), logits.stride()
    picked = greedy_tokens(greedy_cases()[0])
    assert picked[5] == 9 and picked[6] == 20
    greedy = SamplingParams()
    view = greedy_cases()[0]
    want = torch.argmax(view, dim=-1)
    want[6] = NOT_FINITE  # its NaN: sample flags the row rather than pick it (issue 54)
    assert torch.equal(sample(view, [greedy] * 64, [None] * 64), want)


def test_the_native_pick_reads_the_transposed_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layout `weight_major` leaves goes to the native kernel, the others to PyTorch."""
    if not host_kernels.available():
        pytest.skip("the native host kernels are not built here")
    seen: list[tuple[int, ...]] = []
    real = host_kernels.argmax_columns

    def spy(t: torch.Tensor) -> torch.Tensor | None:
        seen.append(tuple(t.shape))
        return real(t)

    monkeypatch.setattr(host_kernels, "argmax_columns", spy)
    for logits in greedy_cases():
        greedy_tokens(logits)
    assert seen == [(32000, 64)]


def test_seeded_sampling_is_reproducible_and_seeds_differ() -> None:
    p = SamplingParams(temperature=1.5, seed=1234)
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))

    def draw(params: SamplingParams) -> list[int]:
        s = SequenceSampler.start(params)
        return [int(sample(logits, [params], [s.next_key()])[0]) for _ in range(30)]

    assert draw(p) == draw(p)
    assert draw(p) != draw(SamplingParams(temperature=1.5, seed=4321))


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    pk = SamplingParams(temperature=1.0, top_k=2, seed=0)
    assert set(sample(logits.expand(300, -1), [pk] * 300, keys(0, 300)).tolist()) == {0, 1}
    pp = SamplingParams(temperature=1.0, top_p=0.85, seed=0)  # 0.5 + 0.3 < 0.85 -> token 2 also kept
    assert set(sample(logits.expand(500, -1), [pp] * 500, keys(0, 500)).tolist()) == {0, 1, 2}


def test_temperature_changes_the_distribution() -> None:
    logits = torch.tensor([[1.0, 0.0]])
    cold, hot = SamplingParams(temperature=0.2, seed=0), SamplingParams(temperature=5.0, seed=0)
    n = 2000
    cold_zero = (sample(logits.expand(n, -1), [cold] * n, keys(0, n)) == 0).float().mean().item()
    hot_zero = (sample(logits.expand(n, -1), [hot] * n, keys(1, n)) == 0).float().mean().item()
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
