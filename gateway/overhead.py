"""The gateway's own time per request: the whole request less its waits on the gRPC API, so that what
the gateway costs can be told apart from what generation takes (docs/openai.md "Overhead")."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import TypeVar

from prometheus_client import Histogram

OVERHEAD = Histogram(
    "moe_lightning_gateway_overhead_seconds",
    "The gateway's own time per request: the whole request less the time spent waiting on the gRPC API",
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
)
T = TypeVar("T")


class Clock:
    """One request's time, and the part of it spent waiting on the gRPC API (`upstream`)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.upstream = 0.0

    async def wait(self, aw: Awaitable[T]) -> T:
        t0 = time.perf_counter()
        try:
            return await aw
        finally:
            self.upstream += time.perf_counter() - t0

    def observe(self) -> None:
        OVERHEAD.observe(max(0.0, time.perf_counter() - self.start - self.upstream))
