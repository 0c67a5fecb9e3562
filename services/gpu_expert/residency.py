"""Which experts live on the device, and streaming the rest through a double buffer.

Within `--device-memory` the device holds the dense weights, `resident` experts of every layer, and
two buffers that each hold one layer's streamed experts. While layer l computes, a worker thread
copies layer l+1's streamed experts from the weight arena into the other buffer; layer l+1 waits
for that copy only if it has not finished. On a CPU "device" the resident experts are the arena's
own pages (zero copy) and the streamed ones are still copied into the budgeted buffers, so the
paging path runs and is tested on every machine.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from prometheus_client import Counter

from moe_lightning.flags import format_size
from moe_lightning.timeline import TimelineRecorder
from moe_lightning.weights import ExpertWeights, ModelWeights

STREAMED = Counter("moe_lightning_expert_bytes_streamed_total", "Expert weight bytes copied into the device buffers")
WAITED = Counter("moe_lightning_expert_wait_seconds_total", "Time a layer waited for its streamed experts")


class DeviceBudgetError(ValueError):
    """The budget cannot hold what must be on the device; raised at start, never mid-run."""


@dataclass(frozen=True, slots=True)
class ResidencyPlan:
    resident: tuple[tuple[int, ...], ...]  # per layer: expert ids kept on the device
    buffer_slots: int  # experts one buffer holds (the most any layer streams)
    expert_bytes: int
    dense_bytes: int
    budget: int

    @property
    def device_bytes(self) -> int:
        resident = sum(len(r) for r in self.resident)
        return self.dense_bytes + (resident + 2 * self.buffer_slots) * self.expert_bytes


def plan_residency(
    num_layers: int,
    num_experts: int,
    expert_bytes: int,
    dense_bytes: int,
    budget: int,
    hot: list[list[int]] | None = None,
) -> ResidencyPlan:
    """Spreads the budget evenly over layers (the double buffer then only needs E - r slots); within
    a layer the hottest experts (by `hot` routing counts, else the lowest ids) stay resident."""
    total = num_layers * num_experts
    if dense_bytes + total * expert_bytes <= budget:
        resident = [tuple(range(num_experts)) for _ in range(num_layers)]
        return ResidencyPlan(tuple(resident), 0, expert_bytes, dense_bytes, budget)
    best = None
    for r in range(num_experts - 1, -1, -1):
        slots = num_experts - r
        base = dense_bytes + (num_layers * r + 2 * slots) * expert_bytes
        if base > budget:
            continue
        extra = min(num_layers, (budget - base) // expert_bytes)  # some layers keep one more expert
        best = (r, slots, int(extra))
        break
    if best is None:
        need = dense_bytes + 2 * num_experts * expert_bytes
        raise DeviceBudgetError(
            f"--device-memory {format_size(budget)} cannot hold the dense weights ({format_size(dense_bytes)}) "
            f"and a double buffer of one layer's experts ({format_size(2 * num_experts * expert_bytes)}): "
            f"at least {format_size(need)} is needed"
        )
    r, slots, extra = best
    resident = []
    for layer in range(num_layers):
        keep = r + (1 if layer < extra and r + 1 < num_experts else 0)
        order = sorted(range(num_experts), key=lambda e: (-hot[layer][e], e)) if hot else list(range(num_experts))
        resident.append(tuple(sorted(order[:keep])))
    return ResidencyPlan(tuple(resident), slots, expert_bytes, dense_bytes, budget)


class ExpertPager:
    """Serves each layer's experts: resident ones directly, streamed ones from a prefetched buffer."""

    def __init__(
        self,
        host: ModelWeights,
        plan: ResidencyPlan,
        device: torch.device,
        timeline: TimelineRecorder | None = None,
        lookahead: bool = True,
    ) -> None:
        self.host = host
        self.plan = plan
        self.device = device
        self.timeline = timeline or TimelineRecorder(None, "gpu_expert")
        self.lookahead = lookahead  # False: copy each layer's experts only when it needs them (no overlap)
        self.num_layers = len(host.layers)
        zero_copy = device.type == "cpu"
        self.resident: list[dict[int, ExpertWeights]] = []
        for layer, ids in zip(host.layers, plan.resident, strict=True):
            self.resident.append(
                {
                    e: layer.experts[e]
                    if zero_copy
                    else ExpertWeights(layer.experts[e].w13.to(device), layer.experts[e].w2.to(device))
                    for e in ids
                }
            )
        proto = host.layers[0].experts[0]
        self.buffers = [
            [
                ExpertWeights(torch.empty_like(proto.w13, device=device), torch.empty_like(proto.w2, device=device))
                for _ in range(plan.buffer_slots)
            ]
            for _ in range(2)
        ]
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expert-pager")
        self._pending: dict[int, Future[dict[int, ExpertWeights]]] = {}
        self._turn = 0  # which buffer the next prefetch fills: they alternate in consumption order
        self._lock = threading.Lock()
        self.bytes_streamed = 0
        self.wait_seconds = 0.0

    @property
    def streams(self) -> bool:
        return self.plan.buffer_slots > 0

    def _copy(self, layer: int, buffer: int) -> dict[int, ExpertWeights]:
        t0 = time.perf_counter_ns()
        streamed = [e for e in range(len(self.host.layers[layer].experts)) if e not in self.resident[layer]]
        out = {}
        for slot, e in zip(self.buffers[buffer], streamed, strict=False):
            src = self.host.layers[layer].experts[e]
            slot.w13.copy_(src.w13)
            slot.w2.copy_(src.w2)
            out[e] = slot
        with self._lock:
            self.bytes_streamed += len(streamed) * self.plan.expert_bytes
        STREAMED.inc(len(streamed) * self.plan.expert_bytes)
        self.timeline.record("copy", "expert_copy", -1, layer, -1, t0)
        return out

    def prefetch(self, layer: int) -> None:
        layer %= self.num_layers
        if self.streams and layer not in self._pending:
            self._pending[layer] = self._pool.submit(self._copy, layer, self._turn)
            self._turn ^= 1

    def layer_experts(self, layer: int) -> list[ExpertWeights]:
        """Layer `layer`'s experts by id; starts the next layer's copy before returning."""
        if not self.streams:
            return [self.resident[layer][e] for e in range(len(self.resident[layer]))]
        self.prefetch(layer)
        t0 = time.perf_counter()
        streamed = self._pending.pop(layer).result()
        waited = time.perf_counter() - t0
        self.wait_seconds += waited
        WAITED.inc(waited)
        if self.lookahead:
            self.prefetch(layer + 1)  # the other buffer is free: layer - 1 is done
        experts = {**self.resident[layer], **streamed}
        return [experts[e] for e in range(len(experts))]

    def update_residency(self, plan: ResidencyPlan) -> None:
        """Between steps: swap which experts stay resident (same counts per layer, so same buffers)."""
        if plan.buffer_slots != self.plan.buffer_slots:
            raise ValueError("a residency update must keep the buffer size")
        self.reset()
        zero_copy = self.device.type == "cpu"
        for layer, ids in enumerate(plan.resident):
            old = self.resident[layer]
            new = {}
            for e in ids:
                src = self.host.layers[layer].experts[e]
                new[e] = old.get(e) or (
                    src if zero_copy else ExpertWeights(src.w13.to(self.device), src.w2.to(self.device))
                )
            self.resident[layer] = new
        self.plan = plan

    def reset(self) -> None:
        """After a failed step: finish outstanding copies and forget them (the next step starts fresh)."""
        for fut in self._pending.values():
            fut.exception()
        self._pending.clear()
        self._turn = 0

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
