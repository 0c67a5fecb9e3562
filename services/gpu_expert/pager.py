"""Serves each layer's experts: resident ones directly, streamed ones from a ring of buffer slots.

The CGOPipe schedule (docs/design.md): the streamed experts of layer l+1 are split into n_ub pages and
page m is issued after micro-batch m of layer l, so the transfer interleaves with compute at
micro-batch grain. A page only takes slots that are free; when the ring is smaller than a double
buffer, the rest are issued as soon as layer l ends and frees its slots. Layer l+1 then waits per
expert, not per layer: a micro-batch blocks only on a page it actually routes tokens to.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
from prometheus_client import Counter

from moe_lightning.timeline import TimelineRecorder
from moe_lightning.weights import ExpertWeights, ModelWeights
from services.gpu_expert.copy_engine import CopyEngine, Ticket, make_copy_engine
from services.gpu_expert.residency import ResidencyPlan

STREAMED = Counter("moe_lightning_expert_bytes_streamed_total", "Expert weight bytes copied into the device buffers")
WAITED = Counter("moe_lightning_expert_wait_seconds_total", "Time compute waited for streamed expert pages")


class LayerExperts(Sequence[ExpertWeights]):
    """One layer's experts by id; a streamed one is waited for on first use."""

    def __init__(self, pager: ExpertPager, layer: int) -> None:
        self.pager = pager
        self.layer = layer
        self.num_experts = pager.plan.experts_per_layer[layer]

    def __len__(self) -> int:
        return self.num_experts

    def __getitem__(self, e: int) -> ExpertWeights:  # type: ignore[override]
        resident = self.pager.resident[self.layer].get(e)
        return resident if resident is not None else self.pager.fetch(self.layer, e)


class ExpertPager:
    def __init__(
        self,
        host: ModelWeights,
        plan: ResidencyPlan,
        device: torch.device,
        timeline: TimelineRecorder | None = None,
        lookahead: bool = True,
        engine: CopyEngine | None = None,
    ) -> None:
        self.host = host
        self.plan = plan
        self.device = device
        self.timeline = timeline or TimelineRecorder(None, "gpu_expert")
        self.lookahead = lookahead  # False: copy a layer's experts only when it starts (no overlap)
        self.engine = engine or make_copy_engine(device, self.timeline)
        self.num_layers = len(host.layers)
        self.resident: list[dict[int, ExpertWeights]] = [
            {e: self._resident_copy(layer, e) for e in ids} for layer, ids in enumerate(plan.resident)
        ]
        # a slot is one expert page's bytes, read through one view (every expert is laid out alike);
        # filled with a real expert, as warm-up and calibration compute on slots and an int4 page's
        # input order (perm) indexes the activations: garbage there would read out of bounds
        proto = host.layers[plan.next_sparse(0)].experts[0]
        self._slot_pages = [proto.page().to(device, copy=True) for _ in range(plan.ring_slots)]
        self.slots = [proto.in_buffer(page) for page in self._slot_pages]
        self._free: deque[int] = deque(range(plan.ring_slots))
        self._issued: dict[int, dict[int, tuple[int, Ticket]]] = {}  # layer -> expert -> (slot, ticket)
        self._waiting: deque[tuple[int, int]] = deque()  # (layer, expert) issued but short of a free slot
        self._ready: set[tuple[int, int]] = set()  # pages already waited for
        self.bytes_streamed = 0
        self.wait_seconds = 0.0

    @property
    def link_seconds(self) -> float:
        """Seconds the link spent copying pages since start, counted as the copies end."""
        return self.engine.busy_seconds

    @property
    def streams(self) -> bool:
        return self.plan.ring_slots > 0

    def _resident_copy(self, layer: int, e: int) -> ExpertWeights:
        src = self.host.layers[layer].experts[e]
        if self.device.type == "cpu":
            return src  # the arena's own page: zero copy
        return src.to(self.device)

    # --- issuing pages --------------------------------------------------------------------------
    def _pending(self, layer: int) -> list[int]:
        """Streamed experts of `layer` not yet issued or queued."""
        issued = self._issued.get(layer, {})
        queued = {e for lay, e in self._waiting if lay == layer}
        return [e for e in self.plan.streamed(layer) if e not in issued and e not in queued]

    def _issue(self, layer: int, experts: list[int]) -> None:
        for e in experts:
            self._waiting.append((layer, e))
        self._drain()

    def _drain(self) -> None:
        """Starts queued pages in order while slots are free (one copy job per contiguous run)."""
        batch: list[tuple[int, int, int]] = []
        while self._waiting and self._free:
            layer, e = self._waiting.popleft()
            batch.append((layer, e, self._free.popleft()))
        by_layer: dict[int, list[tuple[int, int]]] = {}
        for layer, e, slot in batch:
            by_layer.setdefault(layer, []).append((e, slot))
        for layer, pages in by_layer.items():
            pairs = []
            for e, slot in pages:  # one transfer per expert: its page holds weights, scales and zeros
                pairs.append((self._slot_pages[slot], self.host.layers[layer].experts[e].page()))
            ticket = self.engine.copy(pairs, layer)
            issued = self._issued.setdefault(layer, {})
            for e, slot in pages:
                issued[e] = (slot, ticket)
            nbytes = len(pages) * self.plan.expert_bytes
            self.bytes_streamed += nbytes
            STREAMED.inc(nbytes)

    def prefetch_page(self, layer: int, page: int, num_pages: int) -> None:
        """Issues page `page` of `num_pages` of `layer`'s streamed experts (micro-batch grain); a
        dense layer has none, so its pages go to the next layer with experts."""
        if not self.streams or not self.lookahead:
            return
        layer = self.plan.next_sparse(layer)
        streamed = self.plan.streamed(layer)
        per_page = -(-len(streamed) // max(1, num_pages))
        chunk = set(streamed[page * per_page : (page + 1) * per_page])
        self._issue(layer, [e for e in self._pending(layer) if e in chunk])

    # --- consuming -----------------------------------------------------------------------------
    def begin_layer(self, layer: int) -> Sequence[ExpertWeights]:
        """Layer `layer`'s experts; everything it streams is issued by now. Without look-ahead (the
        baseline schedule) this waits for the whole layer's copy before returning."""
        if not self.streams:
            return [self.resident[layer][e] for e in range(self.plan.experts_per_layer[layer])]
        self._issue(layer, self._pending(layer))
        missing = [e for e in self.plan.streamed(layer) if e not in self._issued.get(layer, {})]
        if missing:
            raise RuntimeError(f"layer {layer}: experts {missing} have no buffer slot (ring too small)")
        view = LayerExperts(self, layer)
        if not self.lookahead:
            for e in self.plan.streamed(layer):
                self.fetch(layer, e)
        return view

    def fetch(self, layer: int, e: int) -> ExpertWeights:
        slot, ticket = self._issued[layer][e]
        if (layer, e) not in self._ready:
            waited = ticket.wait()
            self.wait_seconds += waited
            WAITED.inc(waited)
            self._ready.add((layer, e))
        return self.slots[slot]

    def end_layer(self, layer: int) -> None:
        """Layer `layer` is done with its slots; the next layer's remaining pages start now."""
        if not self.streams:
            return
        issued = self._issued.pop(layer, {})
        if issued:
            self.engine.slots_released()
        for e, (slot, _) in issued.items():
            self._ready.discard((layer, e))
            self._free.append(slot)
        self._drain()
        if self.lookahead:
            following = self.plan.next_sparse(layer + 1)
            self._issue(following, self._pending(following))

    def end_step(self) -> None:
        """Between steps: device-side waits of the step are known now (CUDA), and copy spans go to
        the timeline; a prefetch for the next step stays in flight."""
        waited = self.engine.end_step()
        self.wait_seconds += waited
        WAITED.inc(waited)

    # --- residency changes and failures -------------------------------------------------------
    def update_residency(self, plan: ResidencyPlan) -> None:
        """Between steps: swap which experts stay resident (the ring keeps its size)."""
        if plan.ring_slots != self.plan.ring_slots:
            raise ValueError("a residency update must keep the ring size")
        self.reset()
        for layer, ids in enumerate(plan.resident):
            old = self.resident[layer]
            self.resident[layer] = {e: old.get(e) or self._resident_copy(layer, e) for e in ids}
        self.plan = plan

    def reset(self) -> None:
        """After a failed step or before a residency change: let outstanding copies land and forget
        them; the next step starts from an empty ring."""
        for issued in self._issued.values():
            for _, ticket in issued.values():
                ticket.wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._issued.clear()
        self._waiting.clear()
        self._ready.clear()
        self._free = deque(range(self.plan.ring_slots))

    def close(self) -> None:
        self.engine.close()
