"""Copies of expert pages from the host arena into device buffer slots, off the compute path.

Two engines with one interface: on CUDA the arena is registered as pinned memory and copies are
issued on a side stream, each page ending in an event the compute stream waits on (the CPU never
blocks); on a CPU "device" a worker thread does the copies, so the same schedule (and its slot
reuse) runs and is tested on every machine.

A CPU device may also be given a link (`--link-bandwidth`): the copy thread then holds each copy job
to the time its bytes would take on a link of that rate, one job after another as a PCIe link's copy
engine runs them, and sleeps out the rest after the memcpy (no core spins). That makes the link-bound
regime of a small GPU measurable here (docs/cgopipe-and-benchmarks.md, "The link on the CPU").
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
from prometheus_client import Counter

from moe_lightning.config.checks import link_flag_error
from moe_lightning.timeline import TimelineRecorder

# The copy link's busy time; with moe_lightning_expert_wait_seconds_total (its exposed part) it gives
# the share of the copies that overlap hid behind compute.
COPY_SECONDS = Counter("moe_lightning_expert_copy_seconds_total", "Time the link spent copying expert pages")
Pair = tuple[torch.Tensor, torch.Tensor]  # (device slot, host source)


class Ticket(Protocol):
    def wait(self) -> float:
        """Makes the caller's compute see the copied page; returns the seconds the CPU blocked
        (a device-side wait is measured later, by `CopyEngine.end_step`)."""
        ...


class CopyEngine(Protocol):
    # seconds the link spent copying since start, counted as copies end (a step's decode share reads it)
    busy_seconds: float

    def copy(self, pairs: list[Pair], layer: int) -> Ticket: ...

    def slots_released(self) -> None:
        """Compute issued so far is the last user of the slots freed now; later copies may reuse them."""
        ...

    def end_step(self) -> float:
        """Between steps: the seconds the device waited for copies this step (device-side waits
        only), and the copies' timeline spans recorded; never blocks the host."""
        ...

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
    freed by `slots_released` is already unused and needs no fence.

    `link_bandwidth` (bytes/s): a simulated link. A job that starts at t0 ends no earlier than
    t0 + bytes / rate; jobs run one at a time, so a job queued behind another starts when that one
    ends, as on a real link. The memcpy is done first (the slot must hold the page), then the thread
    sleeps out what is left; a memcpy slower than the link just takes its own time."""

    def __init__(self, timeline: TimelineRecorder, link_bandwidth: float | None = None) -> None:
        if link_bandwidth is not None and not link_bandwidth > 0:
            raise ValueError(f"the link's bandwidth must be positive, got {link_bandwidth}")
        self.timeline = timeline
        self.link_bandwidth = link_bandwidth
        self.busy_seconds = 0.0  # written by the copy thread alone
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expert-copy")

    def _run(self, pairs: list[Pair], layer: int) -> None:
        t0 = time.perf_counter_ns()
        for dst, src in pairs:
            dst.copy_(src)
        if self.link_bandwidth is not None:
            nbytes = sum(src.numel() * src.element_size() for _, src in pairs)
            end = t0 + round(nbytes / self.link_bandwidth * 1e9)
            left = end - time.perf_counter_ns()
            if left > 0:
                time.sleep(left / 1e9)  # the link is busy, no core is: sleep, never spin
        t1 = time.perf_counter_ns()
        self.busy_seconds += (t1 - t0) / 1e9
        COPY_SECONDS.inc((t1 - t0) / 1e9)
        self.timeline.record("copy", "expert_copy", -1, layer, -1, t0, t1)

    def copy(self, pairs: list[Pair], layer: int) -> Ticket:
        return _FutureTicket(self._pool.submit(self._run, pairs, layer))

    def slots_released(self) -> None:
        pass

    def end_step(self) -> float:
        return 0.0  # the CPU's waits were counted by the tickets

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class _EventTicket:
    def __init__(self, engine: CudaCopyEngine, event: torch.cuda.Event) -> None:
        self.engine = engine
        self.event = event

    def wait(self) -> float:
        self.engine.device_wait(self.event)
        return 0.0


class CudaCopyEngine:
    """Async host-to-device copies on a side stream. The arena must be pinned (`pin_host_memory`)
    for them to overlap with compute; unpinned sources still give correct, slower copies.

    Every page's events are timed: how long compute actually waited for a page is only known on
    the device (the compute stream's arrival at the wait vs the copy's end), and the timeline wants
    the copies' spans. Both are read after the step, from events that have completed by then."""

    def __init__(self, device: torch.device, timeline: TimelineRecorder) -> None:
        self.device = device
        self.timeline = timeline
        self.stream = torch.cuda.Stream(device)
        self._released: torch.cuda.Event | None = None
        self._spans: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        self._waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # (compute arrives, copy done)
        self._origin: tuple[int, torch.cuda.Event] | None = None
        self.busy_seconds = 0.0

    def copy(self, pairs: list[Pair], layer: int) -> Ticket:
        start = torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            if self._released is not None:
                self.stream.wait_event(self._released)  # the slots' previous layer has finished computing
            if self.timeline.enabled and self._origin is None:
                origin = torch.cuda.Event(enable_timing=True)
                origin.record(self.stream)
                origin.synchronize()  # once per process: anchors device time to the host clock
                self._origin = (time.perf_counter_ns(), origin)
            start.record(self.stream)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            done.record(self.stream)
        self._spans.append((layer, start, done))  # timed whether or not a timeline is kept: the busy counter
        return _EventTicket(self, done)

    def device_wait(self, done: torch.cuda.Event) -> None:
        stream = torch.cuda.current_stream(self.device)
        arrive = torch.cuda.Event(enable_timing=True)
        arrive.record(stream)
        stream.wait_event(done)  # a device-side wait: the host runs on
        self._waits.append((arrive, done))

    def slots_released(self) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._released = event

    def end_step(self) -> float:
        waited = 0.0
        pending = []
        for arrive, done in self._waits:
            if arrive.query() and done.query():
                waited += max(0.0, arrive.elapsed_time(done)) / 1e3
            else:  # not reached yet (a prefetch for the next step): look again after it
                pending.append((arrive, done))
        self._waits = pending
        self._flush_timeline()
        return waited

    def _flush_timeline(self) -> None:
        """Counts the copies that have finished and turns them into timeline spans; a prefetch still in
        flight (the next step's first layer) stays for later, so the host never waits for the copy stream."""
        still = []
        for layer, start, done in self._spans:
            if not done.query():
                still.append((layer, start, done))
                continue
            seconds = max(0.0, start.elapsed_time(done)) / 1e3
            self.busy_seconds += seconds
            COPY_SECONDS.inc(seconds)
            if self._origin is not None:
                origin_ns, origin = self._origin
                t0 = origin_ns + int(origin.elapsed_time(start) * 1e6)
                self.timeline.record(
                    "copy", "expert_copy", -1, layer, -1, t0, origin_ns + int(origin.elapsed_time(done) * 1e6)
                )
        self._spans = still

    def close(self) -> None:
        self.stream.synchronize()
        self._flush_timeline()


def make_copy_engine(
    device: torch.device, timeline: TimelineRecorder, link_bandwidth: float | None = None
) -> CopyEngine:
    """`link_bandwidth`: a simulated link for a CPU device (a CUDA device has its real one)."""
    error = link_flag_error(str(device), link_bandwidth)
    if error:
        raise ValueError(error)
    return CudaCopyEngine(device, timeline) if device.type == "cuda" else ThreadCopyEngine(timeline, link_bandwidth)
