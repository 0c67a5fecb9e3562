"""Which kernel runs a call: the race at the first call of each (weight format and shape, rows bucket,
dtype), and on a CPU the settling of a near tie on the step's own calls.

No kernel is fastest everywhere (kernels.py lists them), so the first call of each bucket races every
candidate on the real operands, each call over a weight evicted from the caches as a decode step reads
it, and keeps the winner: warm-up (kernels.warm_up) is when that happens. On a CPU a runner-up within
SETTLE_WITHIN of the winner is tried against it on the step's own calls, and the faster there keeps
the bucket (Settling). Kernels far behind are timed once (_far_behind) or not at all at more rows
(KernelChooser._pruned). docs/quantization.md, "Kernels", has the measurements behind each rule.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
import torch
from prometheus_client import Gauge

from moe_lightning.quant import host_kernels
from moe_lightning.quant.scheme import QuantFormat

if TYPE_CHECKING:
    from moe_lightning.quant.kernels import Weight

POLICIES = ("fastest", "exact")
MAX_BUCKET = 1024
PRUNE_BEHIND = 8.0  # far behind the best ...
GROWS = 1.5  # ... and slower by this much per doubling of the rows: not timed at more rows (_pruned)
RACE_ROUNDS = 5
# A runner-up the race timed within SETTLE_WITHIN of the winner (on a CPU) is settled on the calls
# themselves: SETTLE_CALLS of each, in a random order, and the faster on average keeps the bucket
# (see Settling).
SETTLE_WITHIN = 1.15
SETTLE_CALLS = 24
# ... for weights of this many bytes or more: read from DRAM at every call, where the race's one evicted
# weight misleads; a smaller weight's call takes microseconds, and its bucket keeps the race's winner
# from the first call (the same inputs then sum in one order from the start, as the tests of the API's
# scoring compare request to request)
SETTLE_MIN_BYTES = 4 << 20
CHOSEN = Gauge(
    "moe_lightning_expert_kernel_seconds",
    "Time of the quantized kernel chosen for a weight shape and rows bucket, as measured when chosen",
    ["shape", "rows", "kernel"],
)
DENSE_CHOSEN = Gauge(
    "moe_lightning_dense_kernel_seconds",
    "Time of the dense GEMM kernel chosen for a weight shape and rows bucket (a CPU's), as measured when chosen",
    ["shape", "rows", "kernel"],
)
Fn = Callable[[torch.Tensor, Any], torch.Tensor]  # (x, the weight of its kernel's format) -> x @ W^T


@contextmanager
def unpublished() -> Iterator[None]:
    """Kernel choices made inside are not exported: a measurement on weights the model does not have
    (the HRM's host-issue calibration on a tiny layer, hrm/host_issue.py) must not add shapes to the
    series that say which kernel each of the model's weights runs."""

    def series(gauge: Gauge) -> set[tuple[str, ...]]:
        return {tuple(s.labels.values()) for m in gauge.collect() for s in m.samples}

    before = {gauge: series(gauge) for gauge in (CHOSEN, DENSE_CHOSEN)}
    try:
        yield
    finally:
        for gauge, had in before.items():
            for labels in series(gauge) - had:
                gauge.remove(*labels)


@dataclass(frozen=True, slots=True)
class Kernel:
    name: str
    format: QuantFormat  # NONE: a dense weight
    fn: Fn
    devices: tuple[str, ...] = ("cpu", "cuda")
    exact_for: tuple[torch.dtype, ...] | None = None  # x's dtypes it is exact for; None: all
    raced_for: tuple[torch.dtype, ...] | None = None  # x's dtypes it is a candidate for; None: all
    native: bool = False  # one of host_kernels.py's: only where the extension is built

    def races(self, dtype: torch.dtype) -> bool:
        return self.raced_for is None or dtype in self.raced_for

    def exact(self, dtype: torch.dtype) -> bool:
        return self.exact_for is None or dtype in self.exact_for

    def usable(self, device: torch.device) -> bool:
        if device.type not in self.devices:
            return False
        if self.name == "int4mm_cuda":  # tinygemm needs tensor cores of compute capability 8.0+
            return torch.cuda.get_device_capability(device) >= (8, 0)
        return not self.native or host_kernels.available()


# Exact: the result is the GEMM on the dequantized weights (fp32 dequantization rounded once to x's
# dtype), up to the order of the sums. Kernels that take scales (and zeros) in x's dtype are exact
# only in fp32; those that round activations or scales to bf16 never are.
# The native kernels compute in fp32 whatever x's dtype: exact in fp32 (`*_f32`, dense_native), never
# with int8 activations (`*_i8`, ~0.7 % of the output's largest value).


def weight_key(w: Weight) -> tuple[QuantFormat, tuple[int, ...], int]:
    """(format, shape, group size) of a weight: what its kernels' speed depends on besides x."""
    if isinstance(w, torch.Tensor):
        return QuantFormat.NONE, tuple(w.shape), 0
    return w.format, w.shape, w.group_size


def rows_bucket(m: int) -> int:
    return min(MAX_BUCKET, 1 << max(0, math.ceil(math.log2(max(1, m)))))


@dataclass(slots=True)
class Settling:
    """The race's winner and a runner-up it timed within SETTLE_WITHIN of it, both tried on the calls
    a step makes until each has run SETTLE_CALLS of them. At decode's 16-32 rows per expert the fp32
    kernels come within a few percent of each other in the race, and which wins flipped from one start
    to the next (the other services starting beside it, the weight read once where a step streams
    gigabytes), while on a step's calls one stays 5-10 % ahead (docs/quantization.md, "Kernels"). The
    order is drawn at random, not alternated: a layer's experts come in the same order every step, and
    a bucket's calls in turns would give each kernel the same experts (and their row counts) each time."""

    kernels: tuple[Kernel, Kernel]
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0])
    calls: list[int] = field(default_factory=lambda: [0, 0])
    draw: random.Random = field(default_factory=lambda: random.Random(0))

    def next(self) -> int:
        """Which kernel runs the next call: either at random until one has had its share."""
        if self.calls[0] >= SETTLE_CALLS:
            return 1
        if self.calls[1] >= SETTLE_CALLS:
            return 0
        return self.draw.randrange(2)

    def settled(self) -> bool:
        return min(self.calls) >= SETTLE_CALLS

    def means(self) -> tuple[float, float]:
        return self.seconds[0] / max(1, self.calls[0]), self.seconds[1] / max(1, self.calls[1])


@dataclass(slots=True)
class Choice:
    kernel: Kernel
    seconds: dict[str, float]  # every candidate's time on the operands it was chosen with
    pruned: frozenset[str] = frozenset()  # not timed: far behind and slower the more rows (see _pruned)
    settling: Settling | None = None  # a near tie, being settled on the calls (then None)
    settled: dict[str, float] = field(default_factory=dict)  # the mean call each had when it was


@dataclass(slots=True)
class KernelChooser:
    kernels: tuple[Kernel, ...]  # the candidates (kernels.KERNELS)
    policy: str = "fastest"
    only: str | None = None  # one kernel by name (tests, benchmarks of a single kernel)
    table: dict[tuple, Choice] = field(default_factory=dict)
    settle: bool = True  # near ties settled on the calls (Settling); False: the race's winner stays

    def candidates(self, fmt: QuantFormat, device: torch.device, dtype: torch.dtype) -> list[Kernel]:
        """The kernels raced for `fmt` weights: `only` where it names one of this format's (the other
        formats keep the policy's), else the policy's."""
        found = [k for k in self.kernels if k.format is fmt and k.usable(device) and k.races(dtype)]
        if self.only is not None and any(k.name == self.only and k.format is fmt for k in self.kernels):
            found = [k for k in found if k.name == self.only]
        elif self.policy == "exact":
            found = [k for k in found if k.exact(dtype)]
        if not found:
            raise ValueError(f"no {self.only or self.policy} kernel for {fmt} weights on {device.type}")
        return found

    def pick(self, x: torch.Tensor, w: Weight) -> Kernel:
        return self._choice(x, w)[0].kernel

    def run(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """x @ W^T by the bucket's kernel; while a near tie is being settled, by either (timed)."""
        choice, fresh = self._choice(x, w)
        trial = choice.settling
        if trial is None or fresh:  # the call that raced ran over a weight the race had just read
            return choice.kernel.fn(x, w)
        i = trial.next()
        y, seconds = _timed_call(trial.kernels[i].fn, x, w)
        trial.seconds[i] += seconds
        trial.calls[i] += 1
        if trial.settled():
            self._settle(x, w, choice, trial)
        return y

    def _choice(self, x: torch.Tensor, w: Weight) -> tuple[Choice, bool]:
        key = (str(x.device), *weight_key(w), rows_bucket(x.shape[0]), x.dtype)
        choice = self.table.get(key)
        if choice is not None:
            return choice, False
        choice = self.table[key] = self._measure(x, w, key)
        return choice, True

    def _settle(self, x: torch.Tensor, w: Weight, choice: Choice, trial: Settling) -> None:
        means = trial.means()
        best = trial.kernels[0 if means[0] <= means[1] else 1]
        fmt, shape, _ = weight_key(w)
        gauge = DENSE_CHOSEN if fmt is QuantFormat.NONE else CHOSEN
        labels = ("x".join(map(str, shape)), str(rows_bucket(x.shape[0])))
        if best is not choice.kernel:
            gauge.remove(*labels, choice.kernel.name)
        gauge.labels(*labels, best.name).set(min(means))
        choice.kernel, choice.settling = best, None
        choice.settled = {k.name: m for k, m in zip(trial.kernels, means, strict=True)}
        structlog.get_logger().info(
            "kernel_settled",
            format=str(fmt),
            shape=list(shape),
            rows=int(labels[1]),
            kernel=best.name,
            mean_ms={k: round(m * 1e3, 3) for k, m in choice.settled.items()},
        )

    def _measure(self, x: torch.Tensor, ql: Weight, key: tuple) -> Choice:
        found = self.candidates(key[1], x.device, x.dtype)
        if len(found) == 1 and self.only is not None:
            return Choice(found[0], {})
        pruned = self._pruned(key)
        found = [k for k in found if k.name not in pruned] or found
        first = {k.name: t for k in found if (t := _first_call(k, x, ql)) is not None}
        behind = _far_behind(first) if x.device.type == "cpu" else {}
        seconds = _race([k for k in found if k.name in first and k.name not in behind], x, ql)
        seconds.update(behind)
        if not seconds:
            raise RuntimeError(f"every kernel for {key[1]} on {x.device} failed")
        best = min(seconds, key=seconds.__getitem__)
        gauge = DENSE_CHOSEN if key[1] is QuantFormat.NONE else CHOSEN
        gauge.labels("x".join(map(str, key[2])), str(key[4]), best).set(seconds[best])
        structlog.get_logger().info(
            "kernel_chosen",
            format=str(key[1]),
            shape=list(key[2]),
            rows=key[4],
            dtype=str(x.dtype).removeprefix("torch."),
            kernel=best,
            ms={k: round(v * 1e3, 3) for k, v in seconds.items()},
        )
        winner = next(k for k in found if k.name == best)
        tie = _near_tie(winner, found, seconds, x.device) if self.settle and _nbytes(ql) >= SETTLE_MIN_BYTES else None
        return Choice(winner, seconds, frozenset(pruned), tie)

    def _pruned(self, key: tuple) -> set[str]:
        """Kernels not worth timing at this rows bucket: more than PRUNE_BEHIND times slower than the
        best at half the rows and growing with the rows (at least GROWS times their time at a quarter),
        so they cannot catch up (int4mm_cpu here: 8 s a call at 1024 rows). One whose time is mostly
        fixed (dequantizing the page) is kept: with more rows the others may fall behind it."""
        half = self.table.get((*key[:4], key[4] // 2, *key[5:]))
        if half is None or not half.seconds or key[4] < 2:
            return set()
        quarter = self.table.get((*key[:4], key[4] // 4, *key[5:]))
        best = min(half.seconds.values())
        out = set(half.pruned)
        for name, t in half.seconds.items():
            earlier = quarter.seconds.get(name) if quarter is not None else None
            if t > PRUNE_BEHIND * best and earlier is not None and t >= GROWS * earlier:
                out.add(name)
        return out

    def report(self) -> list[dict]:
        """What won for each shape and rows bucket, with the times it won by (benchmarks print it)."""
        return [
            {
                "format": str(key[1]),
                "shape": list(key[2]),
                "rows": key[4],
                "dtype": str(key[5]).removeprefix("torch."),
                "kernel": c.kernel.name,
                "ms": {k: round(v * 1e3, 3) for k, v in c.seconds.items()},
                "settled_ms": {k: round(v * 1e3, 3) for k, v in c.settled.items()},  # {}: no near tie
            }
            for key, c in self.table.items()
        ]


def _nbytes(w: Weight) -> int:
    tensors = [w] if isinstance(w, torch.Tensor) else list(w.tensors())
    return sum(t.numel() * t.element_size() for t in tensors)


def _near_tie(winner: Kernel, found: list[Kernel], seconds: dict[str, float], device: torch.device) -> Settling | None:
    """The winner and its closest runner-up where the race could not tell them apart (a CPU's: a CUDA
    call would need a synchronisation to be timed)."""
    if device.type != "cpu":
        return None
    others = sorted((t, k.name) for k in found if k is not winner and (t := seconds.get(k.name)) is not None)
    if not others or others[0][0] > SETTLE_WITHIN * seconds[winner.name]:
        return None
    return Settling((winner, next(k for k in found if k.name == others[0][1])))


def _timed_call(fn: Fn, x: torch.Tensor, ql: Weight) -> tuple[torch.Tensor, float]:
    """A step's call to a kernel being settled (a CPU's: no synchronisation to wait for), and its time."""
    t0 = time.perf_counter()
    y = fn(x, ql)
    return y, time.perf_counter() - t0


def _first_call(kernel: Kernel, x: torch.Tensor, ql: Weight) -> float | None:
    """A first call, not counted in the race (it may load or compile the kernel): its seconds, or None
    if this build or device lacks the kernel."""
    try:
        return _cold_once(kernel.fn, x, ql)
    except torch.OutOfMemoryError:
        raise  # not a missing kernel: the step's own error handling says so
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        error = str(exc).splitlines()[0] if str(exc) else repr(exc)
        structlog.get_logger().warning("kernel_unavailable", kernel=kernel.name, error=error)
        return None


def _far_behind(first: dict[str, float]) -> dict[str, float]:
    """The kernels whose first call alone took PRUNE_BEHIND times the best first call: on a CPU a
    first call costs what the next ones do (nothing loads lazily; these kernels keep no state), and
    timing such a kernel again in the race is what made choosing slow (int4mm_cpu: 1.5 s a call at
    256 rows, where dequant_mm takes 40 ms). Timed once, it keeps that time in the Choice."""
    if not first:
        return {}
    best = min(first.values())
    return {name: t for name, t in first.items() if t > PRUNE_BEHIND * best}


def _race(found: list[Kernel], x: torch.Tensor, ql: Weight, rounds: int = RACE_ROUNDS) -> dict[str, float]:
    """Each kernel's best time over `rounds`, the kernels taking turns within a round, so that a
    burst of load from the other processes (a service starting, the arena copy being written) falls
    on all of them alike; one more than 4x behind the best after a round runs no more."""
    times: dict[str, float] = {}
    alive = list(found)
    for _ in range(rounds):
        for kernel in alive:
            times[kernel.name] = min(times.get(kernel.name, math.inf), _cold_once(kernel.fn, x, ql))
        best = min(times.values())
        alive = [k for k in alive if times[k.name] <= 4 * best]
    return times


def _cold_once(fn: Fn, x: torch.Tensor, ql: Weight) -> float:
    """One call over a weight that comes from DRAM, on a CPU that can evict it (host_kernels.evict): a
    decode step reads each host weight once, after gigabytes of the others, while a weight the race has
    just read sits in the L3, where the kernels rank otherwise (MKL's `weight_major` ahead of
    `dense_native` at 16 rows there, behind it from DRAM; docs/quantization.md, "Kernels")."""
    if x.device.type == "cpu":
        host_kernels.evict([ql] if isinstance(ql, torch.Tensor) else list(ql.tensors()))
    return _once(fn, x, ql)


def _once(fn: Fn, x: torch.Tensor, ql: Weight) -> float:
    sync(x.device)
    t0 = time.perf_counter()
    fn(x, ql)
    sync(x.device)
    return time.perf_counter() - t0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Fn, x: torch.Tensor, ql: Weight, reps: int = 3) -> float:
    """Best of `reps` after an uncounted warm call (bench/quant_kernels.py)."""
    fn(x, ql)
    return min(_once(fn, x, ql) for _ in range(reps))
