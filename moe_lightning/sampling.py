"""Head-side sampling: greedy, temperature, top-k, top-p, reproducible per request by seed."""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
# torch is imported where it computes: the parameters and their checks are the API's and the command
# line's too, which answer bad input without paying torch's import (docs/api.md, "The command line")

MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """log_softmax of the raw logits at one generated position."""

    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """logits: (V,) raw, fp32."""
    import torch

    lp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(lp, min(top, lp.shape[-1]))
    return TokenLogprobs(token, float(lp[token]), ids.tolist(), values.tolist())


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    seed: int | None = None  # fixes the request's random stream; None draws one
    logprobs: int = 0  # return the top this-many log-probabilities at each generated position

    def __post_init__(self) -> None:
        # the one definition of what is allowed: the API turns these into INVALID_ARGUMENT (in this order)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        if self.greedy:
            return None
        import torch

        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed if self.seed is not None else secrets.randbits(63))
        return gen

    def with_seed(self) -> SamplingParams:
        """These parameters with a seed fixed: a drawn one when none was asked for, so a sequence that
        is preempted and re-prefilled on another step resumes the same stream (greedy needs none)."""
        if self.greedy or self.seed is not None:
            return self
        return replace(self, seed=secrets.randbits(63))


_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, draw: int) -> int:
    """The seed of a stream's `draw`-th draw: splitmix64 of (seed, draw), so draw i depends on the two
    numbers alone and not on how many steps produced the draws before it."""
    z = (seed + (draw + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(slots=True)
class SequenceSampler:
    """One sequence's sampling parameters and random stream, where the head keeps them.

    Each draw reseeds the generator from (seed, draw index): a sequence preempted and re-prefilled
    (docs/kv-cache.md) is given the draws it had made and continues its stream exactly, while one
    generator object per sequence keeps the per-token cost to a reseed."""

    params: SamplingParams
    generator: torch.Generator | None
    seed: int
    draws: int = 0  # draws made so far: the index of the next

    @classmethod
    def start(cls, params: SamplingParams, draws: int = 0, device: torch.device | str = "cpu") -> SequenceSampler:
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        generator = None
        if not params.greedy:
            import torch

            generator = torch.Generator(device=device)
        return cls(params, generator, seed, draws)

    def next_generator(self) -> torch.Generator | None:
        """The generator for the next draw (None when greedy), seeded for it."""
        if self.generator is not None:
            self.generator.manual_seed(draw_seed(self.seed, self.draws))
        self.draws += 1
        return self.generator


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    import torch

    # logits: (V,) fp32, already divided by temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token once the mass before it already reaches top_p; the most likely always stays
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """logits: (B, V) -> next token ids (B,) on the CPU."""
    import torch

    logits = logits.float()
    out = torch.argmax(logits, dim=-1).cpu()  # (B,)
    for b, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        # shift first: with a tiny temperature, logits / T overflows to +inf and softmax gives NaN;
        # shifted logits are <= 0, so they can only underflow to -inf (the argmax stays at 0)
        row = _filter((logits[b] - logits[b].max()) / p.temperature, p)
        probs = torch.softmax(row, dim=-1)
        out[b] = torch.multinomial(probs, 1, generator=gen).item()
    return out
