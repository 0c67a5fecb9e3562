"""What is decoded (Workload), how much of each memory a plan may use (Headroom), and how the KV
cache of N sequences is counted against host memory (the KV rule, docs/hrm.md "The KV rule"): the
inputs of the per-layer cost (hrm/layercost.py, which re-exports them). Also the arithmetic the
formulas share, on Python scalars or on numpy arrays (_Ops).

The host KV cache holds N sequences by one of two rules (`kv_rule`): "max", the paper's, counts every
sequence at its maximum context s + n, as a scheduler that reserves prompt + max_new_tokens at
admission holds them; "expected", for a scheduler that takes KV blocks as sequences grow and preempts
when the cache runs out, counts what N sequences at steady state hold on average, N (s + n/2), plus
`Headroom.kv_sigmas` standard deviations of that sum so that preemptions stay rare.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np


@dataclass(frozen=True, slots=True)
class Workload:
    prompt_len: float  # s: average prompt tokens
    gen_len: int  # n: tokens generated per request
    prompt_std: float = 0.0  # standard deviation of the prompt lengths (0: every prompt is s tokens)

    def __post_init__(self) -> None:
        if self.prompt_len <= 0 or self.gen_len <= 0:
            raise ValueError("prompt length and generation length must be positive")
        if self.prompt_std < 0:
            raise ValueError("the prompt lengths' standard deviation cannot be negative")

    @property
    def avg_context(self) -> float:
        """Average attended context over the decode: s + n/2."""
        return self.prompt_len + self.gen_len / 2

    @property
    def max_context(self) -> float:
        return self.prompt_len + self.gen_len

    @property
    def kv_variance(self) -> float:
        """Variance of one sequence's KV tokens at steady state: its prompt's, plus its age's, uniform
        over the n steps of its generation (n^2 / 12)."""
        return self.prompt_std**2 + self.gen_len**2 / 12


@dataclass(frozen=True, slots=True)
class Headroom:
    gpu: float = 0.86  # usable share of device memory (the reference's value)
    cpu: float = 0.80  # usable share of host memory
    # kv_rule "expected": standard deviations of N sequences' total KV kept free beyond its mean. At 3
    # the total exceeds the cache in ~0.1 % of steps (normal tail), each time preempting a few sequences
    kv_sigmas: float = 3.0


# MT-Bench prompts as design.md gives them (77 tokens on average, 418 at most) in the shape
# moe_lightning.benchmark.mtbench_lengths draws (a clipped log-normal): their spread is 0.82 of the mean
MTBENCH_PROMPT_LEN, MTBENCH_PROMPT_STD = 77.0, 63.0

MAX_CONTEXT, EXPECTED_USE = "max", "expected"
KV_RULES = (EXPECTED_USE, MAX_CONTEXT)  # kv_rule's values; the first is the default
# the rule that sizes N for each of the batcher's admissions (orchestrator/batcher.py KV_ADMISSIONS)
KV_RULE_FOR_ADMISSION = {"need": EXPECTED_USE, "reserve": MAX_CONTEXT}


Values = float | np.ndarray  # one policy's number, or a grid's


class _Ops(NamedTuple):
    """What the formula needs beyond + - * /, for Python scalars or for numpy arrays."""

    maximum: Callable[[Any, Any], Any]
    minimum: Callable[[Any, Any], Any]
    ceil: Callable[[Any], Any]
    where: Callable[[Any, Any, Any], Any]  # both values already computed
    invert: Callable[[Any], Any]  # of a condition
    take: Callable[[list[float], Any], Any]  # values[index]
    sqrt: Callable[[Any], Any]


SCALARS = _Ops(max, min, math.ceil, lambda c, x, y: x if c else y, operator.not_, operator.getitem, math.sqrt)
ARRAYS = _Ops(np.maximum, np.minimum, np.ceil, np.where, np.logical_not, lambda v, i: np.asarray(v)[i], np.sqrt)


def check_kv_rule(kv_rule: str) -> str:
    if kv_rule not in KV_RULES:
        raise ValueError(f"kv_rule must be one of {', '.join(KV_RULES)}; got {kv_rule!r}")
    return kv_rule


def kv_tokens(
    n: Values, work: Workload, kv_rule: str = EXPECTED_USE, headroom: Headroom = Headroom(), ops: _Ops = SCALARS
) -> Values:
    """The KV tokens the cache must hold for N sequences (a number, or an array with ARRAYS).

    "max": N (s + n). "expected": at steady state each sequence holds its prompt plus the tokens it
    has generated so far, uniform over 0..n: mean s + n/2, variance kv_variance; the N are independent,
    so their sum has mean N (s + n/2) and standard deviation sqrt(N kv_variance), and the cache keeps
    kv_sigmas of those free. The sum can never pass every sequence's full context, N (s + n) give or
    take the prompts' own spread, so the smaller bound holds (it binds for small N)."""
    if kv_rule == MAX_CONTEXT:
        return n * work.max_context
    check_kv_rule(kv_rule)
    z = headroom.kv_sigmas
    grown = n * work.avg_context + z * ops.sqrt(n * work.kv_variance)
    return ops.minimum(grown, n * work.max_context + z * ops.sqrt(n * work.prompt_std**2))


def largest_fitting(fits: Callable[[int], bool], cap: int, start: int = 1) -> int:
    """The largest N in 0..cap with fits(N) (0 when none), for a fits() that holds up to some N and
    not beyond: doubling up from a guess `start`, or down below it, then bisecting."""
    if cap < 1:
        return 0
    start = max(1, min(start, cap))
    if fits(start):
        low, high = start, start * 2
        while high <= cap and fits(high):
            low, high = high, high * 2
        high = min(high, cap + 1)
    else:
        low, high = 0, start
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def kv_sequences(
    tokens: float, work: Workload, kv_rule: str = EXPECTED_USE, headroom: Headroom = Headroom(), cap: int = 1 << 40
) -> int:
    """How many sequences a cache of `tokens` KV tokens holds by the rule (at most cap)."""
    if kv_rule == MAX_CONTEXT:  # the planner's division before there were rules: the same numbers
        return int(min(cap, tokens // work.max_context))
    guess = int(tokens // work.max_context)  # the reservation rule's N: near, and usually below
    return largest_fitting(lambda n: kv_tokens(n, work, kv_rule, headroom) <= tokens, cap, guess)
