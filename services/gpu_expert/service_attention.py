"""Attention placed in cpu_attention: q/k/v go out through the hand-off, results come back.

One of the two places a step's attention can run (the other is device_attention.py). Whether the
micro-batches overlap (CGOPipe) or go one at a time (the overlap-off baseline) is chosen once at
start; CGOPipe's window is read at each step, from the channels of the session then connected.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from moe_lightning.handoff import pipeline_window
from moe_lightning.service.errors import NotReadyError
from moe_lightning.step_protocol import SequenceWork
from services.gpu_expert.handoff_side import Handoff
from services.gpu_expert.micro_batch import MicroBatchState
from services.gpu_expert.schedule import Groups, Op, cgopipe_steps, grouped_steps, sequential_steps


class ServiceAttention:
    def __init__(self, handoff: Handoff, overlap: bool) -> None:
        self.handoff = handoff
        self.order: Callable[[int, int, Groups | None], Iterator[Op]] = self._cgopipe if overlap else self._sequential

    def check_ready(self) -> None:
        if not self.handoff.connected:
            raise NotReadyError("gpu_expert is not connected to an attention service yet")

    def prepare(self, release: list[int]) -> None:
        self.handoff.queue_release(release)

    def begin(self, mb: list[SequenceWork], st: MicroBatchState) -> None:
        pass  # cpu_attention plans it from the first layer's hand-off

    def send_release(self, step: int) -> None:
        """Ahead of layer 0, which may start new sequences in the freed blocks."""
        self.handoff.send_release(step)

    def _cgopipe(self, num_layers: int, num_micro_batches: int, groups: Groups | None) -> Iterator[Op]:
        """`groups` (schedule.capped_groups of the plan's): None, CGOPipe's own order; else a layer's
        FFN once per group (schedule.py grouped_order)."""
        window = pipeline_window(num_micro_batches, *self.handoff.slots)
        if groups is not None:
            return grouped_steps(num_layers, num_micro_batches, window, groups)
        return cgopipe_steps(num_layers, num_micro_batches, window)

    @staticmethod
    def _sequential(num_layers: int, num_micro_batches: int, groups: Groups | None) -> Iterator[Op]:
        """The overlap-off baseline keeps its one order: grouping is a schedule of the overlap."""
        return sequential_steps(num_layers, num_micro_batches)
