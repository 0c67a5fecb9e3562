"""Which experts live on the device, and how many buffer slots stream the rest.

Within `--device-memory` the device holds the dense weights, `resident` experts of every layer and a
ring of buffer slots for streamed experts. The paper sizes the ring as a double buffer (two layers'
streamed experts: one computing, one filling); when the budget is smaller than that, a ring of at
least one layer's streamed experts still works (the next layer's pages that do not fit wait for the
current layer's slots), so budgets down to the dense weights plus one layer's experts can run.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from moe_lightning.config.checks import DeviceBudgetError, check_dense_fits
from moe_lightning.config.units import format_size


@dataclass(frozen=True, slots=True)
class ResidencyPlan:
    resident: tuple[tuple[int, ...], ...]  # per layer: expert ids kept on the device
    ring_slots: int  # buffer slots for streamed experts (0 when nothing streams)
    expert_bytes: int
    dense_bytes: int
    budget: int
    experts_per_layer: tuple[int, ...]  # E, or 0 for a dense layer (no experts to keep or stream)

    @property
    def max_streamed(self) -> int:
        """The most experts any one layer streams: the ring must hold at least this many."""
        return max((n - len(r) for n, r in zip(self.experts_per_layer, self.resident, strict=True)), default=0)

    def streamed(self, layer: int) -> list[int]:
        return [e for e in range(self.experts_per_layer[layer]) if e not in self.resident[layer]]

    def next_sparse(self, layer: int) -> int:
        """The first layer at or after `layer` (wrapping to the next step) that has experts."""
        n = len(self.experts_per_layer)
        for i in range(n):
            if self.experts_per_layer[(layer + i) % n]:
                return (layer + i) % n
        return layer % n

    @property
    def device_bytes(self) -> int:
        resident = sum(len(r) for r in self.resident)
        return self.dense_bytes + (resident + self.ring_slots) * self.expert_bytes

    @property
    def double_buffered(self) -> bool:
        return self.ring_slots >= 2 * self.max_streamed


def plan_residency(
    num_layers: int,
    num_experts: int,
    expert_bytes: int,
    dense_bytes: int,
    budget: int,
    hot: list[list[int]] | None = None,
    stream: bool = True,
    dense_layers: Collection[int] = (),
) -> ResidencyPlan:
    """Spreads residency evenly over the sparse layers (so every one streams about the same number of
    experts; `dense_layers` have none); within a layer the hottest experts (by `hot` routing counts,
    else the lowest ids) stay.

    Preference order: a full double buffer with as many resident experts as fit beside it; if not
    even r = 0 leaves room for a double buffer, a ring between one and two layers' worth. With
    `stream=False` (experts placed on the host) there is no ring: all the room goes to residency.
    """
    per_layer = tuple(0 if layer in dense_layers else num_experts for layer in range(num_layers))
    sparse = [layer for layer in range(num_layers) if per_layer[layer]]
    if not sparse:
        raise ValueError("a model without sparse layers has no experts to place")
    total = len(sparse) * num_experts

    def plan(r: int, ring: int, extra: int) -> ResidencyPlan:
        resident: list[tuple[int, ...]] = [()] * num_layers
        for k, layer in enumerate(sparse):
            keep = r + (1 if k < extra and r + 1 < num_experts else 0)
            order = sorted(range(num_experts), key=lambda e: (-hot[layer][e], e)) if hot else list(range(num_experts))
            resident[layer] = tuple(sorted(order[:keep]))
        return ResidencyPlan(tuple(resident), ring, expert_bytes, dense_bytes, budget, per_layer)

    if dense_bytes + total * expert_bytes <= budget:
        return plan(num_experts, 0, 0)
    slots = (budget - dense_bytes) // expert_bytes if budget > dense_bytes else 0
    if not stream:
        check_dense_fits(budget, dense_bytes)  # the launcher asked the same before it started anything
        return plan(int(slots) // len(sparse), 0, int(slots) % len(sparse))
    for r in range(num_experts - 1, -1, -1):
        ring = 2 * (num_experts - r)
        if len(sparse) * r + ring <= slots:
            extra = min(len(sparse), slots - len(sparse) * r - ring)  # some layers keep one more expert
            return plan(r, ring, int(extra))
    if slots >= num_experts:  # a single buffer plus part of the next layer's pages
        return plan(0, int(slots), 0)
    raise DeviceBudgetError(
        f"--device-memory {format_size(budget)} cannot hold the dense weights ({format_size(dense_bytes)}) "
        f"and one layer's streamed experts ({format_size(num_experts * expert_bytes)}): at least "
        f"{format_size(dense_bytes + num_experts * expert_bytes)} is needed "
        f"({format_size(dense_bytes + 2 * num_experts * expert_bytes)} for a full double buffer), "
        "or compute the streamed experts on the host (--experts-placement cpu)"
    )
