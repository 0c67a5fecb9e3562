"""--count-syncs: how often a step made the host wait for the device. Chosen once at start: a step
either runs as it is, or counted: on CUDA under torch's sync debug mode (which warns once per sync),
on any other device by moe_lightning/host_syncs.py, which counts the reads that would be syncs on
CUDA, so that a CPU test can hold the CUDA path's count (issue 53: per decode step, independent of the
number of micro-batches)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

import torch
from prometheus_client import Counter

from moe_lightning.host_syncs import count_host_syncs
from moe_lightning.step_protocol import StepKind

SYNCS = Counter(
    "moe_lightning_host_syncs_total",
    "Host synchronisations with the device (--count-syncs; on a CPU device, the reads that would be one on CUDA)",
    ["kind"],
)
T = TypeVar("T")


def uncounted(kind: StepKind, run: Callable[[], T]) -> T:
    return run()


def counting_cuda_syncs(kind: StepKind, run: Callable[[], T]) -> T:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    SYNCS.labels(kind).inc(sum("synchroniz" in str(w.message) for w in caught))
    return out


def counting_host_reads(kind: StepKind, run: Callable[[], T]) -> T:
    with count_host_syncs() as syncs:
        out = run()
    SYNCS.labels(kind).inc(syncs.count)
    return out


def sync_count_part(count_syncs: bool, device: torch.device) -> Callable[[StepKind, Callable[[], T]], T]:
    if not count_syncs:
        return uncounted
    return counting_cuda_syncs if device.type == "cuda" else counting_host_reads
