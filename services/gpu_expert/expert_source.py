"""Where a step's experts come from: the runner's expert part, chosen once at start.

With a pager (every gpu_expert has one) the experts placement of each step picks how a layer gets
them: streamed into the pager's ring (experts on the device), or the resident ones plus the rest
computed where they live (experts on the host: no transfer). Without one (a runner built from
weights alone) each layer computes with the experts its weights hold. Either way the runner calls
the same three things per layer, in the order schedule.py gives, and never asks which it has.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from moe_lightning.placement import Side
from moe_lightning.weights import ExpertWeights, ModelWeights
from services.gpu_expert.pager import ExpertPager

RowsRule = Callable[[int], bool]  # rows of an FFN pass -> whether they may skip reading their counts back


def never(rows: int) -> bool:
    return False


class LayerSource(Protocol):
    """A step's way of getting each layer's experts (None: the layer's own)."""

    def host_counts(self, rows: int) -> bool:
        """Whether an FFN pass of `rows` rows reads its routing counts back to slice (a host
        synchronisation on CUDA), or runs every expert on every row (stages/moe.py, routes_on_device):
        only where every expert it serves computes on the device."""
        ...

    def begin_layer(self, layer: int) -> Sequence[ExpertWeights] | None: ...
    def prefetch(self, layer: int, page: int, num_pages: int) -> None: ...
    def end_layer(self, layer: int) -> None: ...


class Streamed:
    """Non-resident experts streamed into the ring: page m of the next layer after micro-batch m."""

    def __init__(self, pager: ExpertPager, on_device: RowsRule) -> None:
        self.pager = pager
        self.on_device = on_device

    def host_counts(self, rows: int) -> bool:
        return not self.on_device(rows)

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

    def host_counts(self, rows: int) -> bool:
        return True  # an expert on the host would compute every row: its counts pay for the slicing

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

    def __init__(self, on_device: RowsRule) -> None:
        self.on_device = on_device

    def host_counts(self, rows: int) -> bool:
        return not self.on_device(rows)

    def begin_layer(self, layer: int) -> Sequence[ExpertWeights] | None:
        return None

    def prefetch(self, layer: int, page: int, num_pages: int) -> None:
        pass

    def end_layer(self, layer: int) -> None:
        pass


class PagedExperts:
    """The pager across steps: its counters, its resets, and the source that serves a step's experts
    placement. Pages prefetched for one placement are dropped when a step asks for the other."""

    def __init__(self, pager: ExpertPager, weights: ModelWeights, on_device: RowsRule) -> None:
        self.pager = pager
        self.sources: dict[Side, LayerSource] = {
            Side.DEVICE: Streamed(pager, on_device),
            Side.HOST: OnHost(pager, weights),
        }
        self.serving: Side | None = None  # the placement the prefetched pages serve

    def for_step(self, experts: Side) -> LayerSource:
        if experts != self.serving:
            self.pager.reset()
        self.serving = experts
        return self.sources[experts]

    def counters(self) -> tuple[float, int, float]:
        """(seconds compute waited for pages, bytes streamed, seconds the link copied), all since start."""
        return self.pager.wait_seconds, self.pager.bytes_streamed, self.pager.link_seconds

    def end_step(self) -> None:
        self.pager.end_step()

    def reset(self) -> None:
        self.pager.reset()


class WeightsExperts:
    """No pager: nothing streams, nothing waits, nothing to reset."""

    def __init__(self, weights: ModelWeights, device: torch.device, on_device: RowsRule) -> None:
        experts = [e for layer in weights.layers for e in layer.experts[:1]]
        self.source = LayersOwn(on_device if all(e.w13.device == device for e in experts) else never)

    def for_step(self, experts: Side) -> LayerSource:
        return self.source

    def counters(self) -> tuple[float, int, float]:
        return 0.0, 0, 0.0

    def end_step(self) -> None:
        pass

    def reset(self) -> None:
        pass


def expert_part(
    pager: ExpertPager | None, weights: ModelWeights, device: torch.device, on_device: RowsRule = never
) -> PagedExperts | WeightsExperts:
    """`on_device`: where the experts all compute on the device, which FFN passes skip reading their
    counts back (the runner's choice: on CUDA, stages/moe.py's routes_on_device)."""
    if pager is not None:
        return PagedExperts(pager, weights, on_device)
    return WeightsExperts(weights, device, on_device)
