"""--count-syncs: how often a step made the host wait for the device (CUDA only). Chosen once at
start: a step either runs as it is, or under torch's sync debug mode, which warns once per sync."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

import torch
from prometheus_client import Counter

from moe_lightning.step_protocol import StepKind

SYNCS = Counter("moe_lightning_cuda_syncs_total", "Host synchronisations with the device (--count-syncs)", ["kind"])
T = TypeVar("T")


def uncounted(kind: StepKind, run: Callable[[], T]) -> T:
    return run()


def counting_syncs(kind: StepKind, run: Callable[[], T]) -> T:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    SYNCS.labels(kind).inc(sum("synchroniz" in str(w.message) for w in caught))
    return out


def sync_count_part(count_syncs: bool, device: torch.device) -> Callable[[StepKind, Callable[[], T]], T]:
    return counting_syncs if count_syncs and device.type == "cuda" else uncounted
