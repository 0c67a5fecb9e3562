"""Copies of expert pages from the host arena into device buffer slots, off the compute path.

Two engines with one interface: on CUDA the arena is registered as pinned memory and copies are
issued on a side stream, each page ending in an event the compute stream waits on (the CPU never
blocks); on a CPU "device" a worker thread does the copies, so the same schedule (and its slot
reuse) runs and is tested on every machine.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import structlog
import torch

from moe_lightning.timeline import TimelineRecorder

Pair = tuple[torch.Tensor, torch.Tensor]  # (device slot, host source)


class Ticket(Protocol):
    def wait(self) -> float:
        """Makes the caller's compute see the copied page; returns the seconds the CPU blocked."""
        ...


class CopyEngine(Protocol):
    def copy(self, pairs: list[Pair], layer: int) -> Ticket: ...

    def slots_released(self) -> None:
        """Compute issued so far is the last user of the slots freed now; later copies may reuse them."""
        ...

    def flush_timeline(self) -> None: ...

    def close(self) -> None: ...


class _FutureTicket:
    def __init__(self, future: Future[None]) -> None:
        self.future = future

    def wait(self) -> float:
        if self.future.done():
            self.future.result()
            return 0.0
        t0 = time.perf_counter()
        self.future.result()
        return time.perf_counter() - t0


class ThreadCopyEngine:
    """One worker thread, copies in issue order. Compute on a CPU device is synchronous, so a slot
    freed by `slots_released` is already unused and needs no fence."""

    def __init__(self, timeline: TimelineRecorder) -> None:
        self.timeline = timeline
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expert-copy")

    def _run(self, pairs: list[Pair], layer: int) -> None:
        t0 = time.perf_counter_ns()
        for dst, src in pairs:
            dst.copy_(src)
        self.timeline.record("copy", "expert_copy", -1, layer, -1, t0)

    def copy(self, pairs: list[Pair], layer: int) -> Ticket:
        return _FutureTicket(self._pool.submit(self._run, pairs, layer))

    def slots_released(self) -> None:
        pass

    def flush_timeline(self) -> None:
        pass

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class _EventTicket:
    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self.event = event
        self.device = device

    def wait(self) -> float:
        torch.cuda.current_stream(self.device).wait_event(self.event)  # a GPU-side wait
        return 0.0


class CudaCopyEngine:
    """Async host-to-device copies on a side stream. The arena must be pinned (`pin_host_memory`)
    for them to overlap with compute; unpinned sources still give correct, slower copies."""

    def __init__(self, device: torch.device, timeline: TimelineRecorder) -> None:
        self.device = device
        self.timeline = timeline
        self.stream = torch.cuda.Stream(device)
        self._released: torch.cuda.Event | None = None
        self._spans: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        self._origin: tuple[int, torch.cuda.Event] | None = None

    def copy(self, pairs: list[Pair], layer: int) -> Ticket:
        timed = self.timeline.enabled
        start = torch.cuda.Event(enable_timing=timed)
        done = torch.cuda.Event(enable_timing=timed)
        with torch.cuda.stream(self.stream):
            if self._released is not None:
                self.stream.wait_event(self._released)  # the slots' previous layer has finished computing
            if timed and self._origin is None:
                origin = torch.cuda.Event(enable_timing=True)
                origin.record(self.stream)
                origin.synchronize()
                self._origin = (time.perf_counter_ns(), origin)
            start.record(self.stream)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            done.record(self.stream)
        if timed:
            self._spans.append((layer, start, done))
        return _EventTicket(done, self.device)

    def slots_released(self) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._released = event

    def flush_timeline(self) -> None:
        """Turns the copy events of the step into timeline spans (called between steps)."""
        if not self._spans or self._origin is None:
            return
        origin_ns, origin = self._origin
        for layer, start, done in self._spans:
            done.synchronize()
            t0 = origin_ns + int(origin.elapsed_time(start) * 1e6)
            self.timeline.record(
                "copy", "expert_copy", -1, layer, -1, t0, origin_ns + int(origin.elapsed_time(done) * 1e6)
            )
        self._spans.clear()

    def close(self) -> None:
        self.stream.synchronize()


def make_copy_engine(device: torch.device, timeline: TimelineRecorder) -> CopyEngine:
    return CudaCopyEngine(device, timeline) if device.type == "cuda" else ThreadCopyEngine(timeline)


def pin_host_memory(buffer: torch.Tensor) -> bool:
    """Registers host memory (the weight arena) with CUDA as page-locked, so copies from it are DMA
    transfers that overlap with compute. Returns False where that is not possible (no CUDA, or the
    driver refused); copies then still work, staged through a pinned bounce buffer by the driver."""
    if not torch.cuda.is_available():
        return False
    ptr, size = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    ok = int(getattr(err, "value", err)) == 0
    log = structlog.get_logger()
    if ok:
        log.info("arena_pinned", bytes=size)
    else:
        log.warning("arena_not_pinned", bytes=size, cuda_error=str(err))
    return ok


def unpin_host_memory(buffer: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
