"""The exponential race's randomness: splitmix64 of (draw key, token id), on the host for one number
(`draw_seed`) and on the device for every row and token of a step at once (`race_noise`). sampling.py
draws with it; a row's draw depends on its seed, its draw index and its logits alone."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, draw: int) -> int:
    """The seed of a stream's `draw`-th draw: splitmix64 of (seed, draw), so draw i depends on the two
    numbers alone and not on how many steps produced the draws before it."""
    z = (seed + (draw + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


# A draw is the exponential race: the token maximising p / q, q ~ Exp(1) drawn for every token, which
# picks token i with probability p_i, taken in log space (x - log q, x the filtered logits / T) so no
# softmax is needed. q comes from a counter-based stream computed on the device for all rows at once:
# token t of the draw keyed k (`SequenceSampler.next_key`) gets u from splitmix64's output
# `draw_seed(k, t)`, so a row's draw depends on (seed, draw index) and its logits alone, never on the
# batch, a step count or a generator's state (the same integers on a CPU and a GPU), and costs no launch
# per row: one torch.Generator per row, reseeded per draw, would cost an exponential_ launch each.
GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64's constants as int64: torch's integers are signed
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_U_BITS = 23  # (n + 0.5) / 2^23 is exact in fp32 and never 0 or 1, so q is finite and > 0


def _xor_shift(z: torch.Tensor, s: int) -> None:
    # z ^= z >>> s: torch's >> is arithmetic, so the ones it shifts into a negative z are masked off
    z ^= (z >> s).bitwise_and_((1 << (64 - s)) - 1)


def race_noise(keys: torch.Tensor, ids: torch.Tensor, *, stepped: bool = False) -> torch.Tensor:
    """keys: (R,) int64 draw keys, ids: (R, N) or (1, N) int64 token ids -> (R, N) fp32 log q, q ~ Exp(1)
    with u = ((draw_seed(key, id) >> 40) + 0.5) / 2^23, q = -log u. Products wrap modulo 2^64 on
    every device, as splitmix64's do (tests/test_batched_sampling.py checks it against `draw_seed`).
    stepped: `ids` is already (ids + 1) * golden ratio, splitmix64's steps (`sample` makes them once)."""
    z = keys[:, None] + (ids if stepped else ids * GOLDEN + GOLDEN)  # the state after id + 1 steps
    _xor_shift(z, 30)
    z *= _MIX1
    _xor_shift(z, 27)
    z *= _MIX2
    _xor_shift(z, 31)
    u = (z >> (63 - _U_BITS)).bitwise_and_((1 << _U_BITS) - 1).float().add_(0.5).mul_(2.0**-_U_BITS)
    return u.log_().neg_().log_()


def race(x: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor, stepped: bool) -> torch.Tensor:
    """x: (R, N) fp32 log-weights (-inf: excluded); ids: (R, N) their token ids, or `stepped`: (1, N) the
    steps of 0..N-1 (race_noise's) -> (R,) the tokens drawn."""
    import torch

    pos = torch.sub(x, race_noise(keys, ids, stepped=stepped)).argmax(dim=-1)
    return pos if stepped else ids.gather(1, pos[:, None]).squeeze(1)
