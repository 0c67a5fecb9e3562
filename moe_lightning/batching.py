"""Variable-length micro-batching (the paper's balancing): no padding, even work per micro-batch."""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def balance(lengths: Sequence[int], num_micro_batches: int) -> list[list[int]]:
    """Indices of `lengths` in `num_micro_batches` groups: longest first, each into the group with the
    smallest token sum so far. Attention cost grows with context, so equal sums mean equal work."""
    n = max(1, min(num_micro_batches, len(lengths)))
    heap = [(0, g) for g in range(n)]  # (token sum, group)
    groups: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        total, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (total + lengths[i], g))
    return [g for g in groups if g]
