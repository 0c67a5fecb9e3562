"""Routing counts per (layer, expert): what hot-expert residency ranks, and what Prometheus exports.

Two tallies, because they answer different questions: `hot` is decayed at every residency update
(recent routing counts most), while the exported counter must rise by exactly the tokens routed.
Both stay on the device and are added to without a host synchronisation; the exported one is
read back every EXPORT_EVERY decode steps, since a label lookup per series per step would cost more
than the step's hand-offs.
"""

from __future__ import annotations

import torch
from prometheus_client import Counter

ROUTED = Counter("moe_lightning_expert_routed_tokens_total", "Tokens routed to each expert", ["layer", "expert"])
EXPORT_EVERY = 16  # decode steps between flushes of the exported counter


class RoutingCounts:
    def __init__(self, num_layers: int, num_experts: int, device: torch.device) -> None:
        self.hot = torch.zeros(num_layers, num_experts, dtype=torch.long, device=device)  # (L, E), decayed
        self._unexported = torch.zeros_like(self.hot)  # (L, E) routed since the last export

    def add(self, layer: int, counts: torch.Tensor) -> None:
        """counts: (E,) tokens routed to each expert of `layer` (empty for a dense layer)."""
        if counts.numel():
            self.hot[layer] += counts
            self._unexported[layer] += counts

    def export(self) -> None:
        new = self._unexported.to("cpu", copy=True)  # a copy: on a CPU device .cpu() would alias
        self._unexported.zero_()
        for layer, expert in new.nonzero().tolist():
            ROUTED.labels(str(layer), str(expert)).inc(int(new[layer, expert]))

    def ranking(self) -> list[list[int]]:
        return self.hot.tolist()

    def decay(self) -> None:
        self.hot //= 2
