"""Stage times as the device sees them.

On a CPU device a stage's time is host time around the call. On CUDA the host only launches
kernels, so host time would measure launches, not work: each mark is an event recorded on the
compute stream, and the step's spans are resolved once it has ended (the sampled tokens' copy to
the host already waited for the stream, so nothing blocks). Timeline spans land on the host's
monotonic clock through an origin event recorded when the step starts, while the device is idle
(the previous step ended with that same copy).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moe_lightning.timeline import TimelineRecorder

Mark = int | torch.cuda.Event  # perf_counter_ns on a CPU device, a timed event on CUDA


@dataclass(slots=True)
class _Span:
    timing: str  # the key in the step's timings (ns summed)
    stage: str  # the timeline's stage name
    layer: int
    micro_batch: int
    start: Mark
    end: Mark


class StageClock:
    def __init__(self, device: torch.device, timeline: TimelineRecorder) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.timeline = timeline
        self._spans: list[_Span] = []
        self._origin: tuple[int, torch.cuda.Event] | None = None

    def begin_step(self) -> None:
        self._spans.clear()
        if self.cuda:
            origin = torch.cuda.Event(enable_timing=True)
            origin.record(torch.cuda.current_stream(self.device))
            self._origin = (time.perf_counter_ns(), origin)

    def mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter_ns()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def span(self, timing: str, stage: str, layer: int, micro_batch: int, start: Mark, end: Mark) -> None:
        self._spans.append(_Span(timing, stage, layer, micro_batch, start, end))

    def finish(self, step: int) -> dict[str, int]:
        """ns per timing key of the step; records the timeline. Call after the step's results
        reached the host."""
        totals: dict[str, int] = {}
        for s in self._spans:
            ns = self._ns(s.start, s.end)
            totals[s.timing] = totals.get(s.timing, 0) + ns
            t0 = self._host_ns(s.start)
            self.timeline.record("device", s.stage, step, s.layer, s.micro_batch, t0, t0 + ns)
        self._spans.clear()
        return totals

    def _ns(self, start: Mark, end: Mark) -> int:
        if isinstance(start, int) and isinstance(end, int):
            return end - start
        assert isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event)
        end.synchronize()  # already complete after the step's last copy: no wait in practice
        return int(start.elapsed_time(end) * 1e6)

    def _host_ns(self, mark: Mark) -> int:
        if isinstance(mark, int):
            return mark
        assert self._origin is not None
        origin_ns, origin = self._origin
        return origin_ns + int(origin.elapsed_time(mark) * 1e6)
