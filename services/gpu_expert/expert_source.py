"""Where a step's experts come from: the runner's expert part, chosen once at start.

With a pager (every gpu_expert has one) the experts placement of each step picks how a layer gets
them: streamed into the pager's ring (experts on the device), or the resident ones plus the rest
computed where they live (experts on the host: no transfer). Without one (a runner built from
weights alone) each layer computes with the experts its weights hold. Either way the runner calls
the same three things per layer, in the order schedule.py gives, and never asks which it has.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from moe_lightning.placement import Side
from moe_lightning.weights import ExpertWeights, ModelWeights
from services.gpu_expert.pager import ExpertPager


class LayerSource(Protocol):
    """A step's way of getting each layer's experts (None: the layer's own)."""

    def begin_layer(self, layer: int) -> Sequence[ExpertWeights] | None: ...
    def prefetch(self, layer: int, page: int, num_pages: int) -> None: ...
    def end_layer(self, layer: int) -> None: ...


class Streamed:
    """Non-resident experts streamed into the ring: page m of the next layer after micro-batch m."""

    def __init__(self, pager: ExpertPager) -> None:
        self.pager = pager

    def begin_layer(self, layer: int) -> Sequence[ExpertWeights] | None:
        return self.pager.begin_layer(layer)

    def prefetch(self, layer: int, page: int, num_pages: int) -> None:
        self.pager.prefetch_page(layer, page, num_pages)

    def end_layer(self, layer: int) -> None:
        self.pager.end_layer(layer)


class OnHost:
    """Non-resident experts compute where they live: the resident ones on the device, no transfer."""

    def __init__(self, pager: ExpertPager, weights: ModelWeights) -> None:
        self.pager, self.weights = pager, weights

    def begin_layer(self, layer: int) -> Sequence[ExpertWeights] | None:
        resident = self.pager.resident[layer]  # read per layer: a residency update swaps the dicts
        host = self.weights.layers[layer].experts
        return [resident.get(e) or host[e] for e in range(len(host))]

    def prefetch(self, layer: int, page: int, num_pages: int) -> None:
        pass

    def end_layer(self, layer: int) -> None:
        pass


class LayersOwn:
    """No pager: each layer computes with the experts its weights hold."""

    def begin_layer(self, layer: int) -> Sequence[ExpertWeights] | None:
        return None

    def prefetch(self, layer: int, page: int, num_pages: int) -> None:
        pass

    def end_layer(self, layer: int) -> None:
        pass


class PagedExperts:
    """The pager across steps: its counters, its resets, and the source that serves a step's experts
    placement. Pages prefetched for one placement are dropped when a step asks for the other."""

    def __init__(self, pager: ExpertPager, weights: ModelWeights) -> None:
        self.pager = pager
        self.sources: dict[Side, LayerSource] = {Side.DEVICE: Streamed(pager), Side.HOST: OnHost(pager, weights)}
        self.serving: Side | None = None  # the placement the prefetched pages serve

    def for_step(self, experts: Side) -> LayerSource:
        if experts != self.serving:
            self.pager.reset()
        self.serving = experts
        return self.sources[experts]

    def counters(self) -> tuple[float, int]:
        """(seconds compute waited for pages, bytes streamed), both since start."""
        return self.pager.wait_seconds, self.pager.bytes_streamed

    def end_step(self) -> None:
        self.pager.end_step()

    def reset(self) -> None:
        self.pager.reset()


class WeightsExperts:
    """No pager: nothing streams, nothing waits, nothing to reset."""

    def __init__(self) -> None:
        self.source = LayersOwn()

    def for_step(self, experts: Side) -> LayerSource:
        return self.source

    def counters(self) -> tuple[float, int]:
        return 0.0, 0

    def end_step(self) -> None:
        pass

    def reset(self) -> None:
        pass


def expert_part(pager: ExpertPager | None, weights: ModelWeights) -> PagedExperts | WeightsExperts:
    return PagedExperts(pager, weights) if pager is not None else WeightsExperts()
