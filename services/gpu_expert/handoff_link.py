"""gpu_expert's two ends of the hand-off with cpu_attention: q/k/v out, attention results in.

On a CPU device a send copies into the channel's slot and publishes it at once, and a received
result is used in place (zero copy) until `done_with_input`. On CUDA neither direction may block
the host, or it can never run ahead of the device and every launch gap shows (docs/design.md):
the channel segments are registered as pinned memory; q/k/v are copied into their slot on a
device-to-host stream after the compute that produced them, and a publisher thread posts the slot
once that copy's event completes (in reservation order, so the reader sees FIFO); a result is
copied onto the device on a host-to-device stream the compute stream waits for, and its slot is
handed back once that short copy is done, at the next receive.
"""

from __future__ import annotations

import queue
import threading

import grpc
import structlog
import torch

from moe_lightning.handoff import AttentionHandoff, QKVHandoff, ReleaseHandoff
from moe_lightning.kv_cache import KVCacheFullError
from moe_lightning.service.errors import ServiceError
from moe_lightning.service.metrics import HANDOFF_LATENCY, HANDOFF_WORK, HANDOFFS
from moe_lightning.shm.channel import (
    ChannelClosedError,
    ChannelTimeoutError,
    OutgoingSlot,
    PeerDiedError,
    TensorChannel,
)
from services.gpu_expert.pinned import pin_host_memory, unpin_host_memory


class _Publisher:
    """Posts slots whose device-to-host copies were issued, in order, once each copy is done."""

    def __init__(self, channel: TensorChannel) -> None:
        self.channel = channel
        self._queue: queue.Queue[tuple[torch.cuda.Event, OutgoingSlot, bytes] | None] = queue.Queue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="handoff-publisher", daemon=True)
        self._thread.start()

    def put(self, done: torch.cuda.Event, slot: OutgoingSlot, meta: bytes) -> None:
        if self.error is not None:
            raise self.error
        self._queue.put((done, slot, meta))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            done, slot, meta = item
            try:
                done.synchronize()  # releases the GIL while it waits
                if self.error is None:
                    self.channel.publish(slot, meta)
            except BaseException as exc:  # reported to the sender at its next call
                self.error = exc
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Waits until every queued slot is published (or failed)."""
        self._queue.join()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)


class HandoffLink:
    def __init__(self, output: TensorChannel, device: torch.device, timeout: float = 60.0) -> None:
        self.output = output
        self.input: TensorChannel | None = None
        self.device = device
        self.timeout = timeout
        self.session = 0
        self.outstanding = 0  # q/k/v sent whose result has not been received yet
        self.log = structlog.get_logger()
        self.cuda = device.type == "cuda"
        self._held: torch.cuda.Event | None = None  # the received slot is free once this completes
        self._pinned: list[torch.Tensor] = []
        if self.cuda:
            self._d2h = torch.cuda.Stream(device)
            self._h2d = torch.cuda.Stream(device)
            self._publisher = _Publisher(output)
            self._pin(output)

    def _pin(self, channel: TensorChannel) -> None:
        buffer = channel.segment.bytes()
        if pin_host_memory(buffer, self.device):
            self._pinned.append(buffer)

    def _unpin(self, channel: TensorChannel) -> None:
        buffer = channel.segment.bytes()
        for i, b in enumerate(self._pinned):
            if b.data_ptr() == buffer.data_ptr():
                unpin_host_memory(b, self.device)
                del self._pinned[i]
                return

    @property
    def slots(self) -> tuple[int, int]:
        """(slots of the q/k/v channel, slots of the results channel)."""
        return self.output.slots, self.input.slots if self.input is not None else self.output.slots

    def connect(self, input_channel: str, session: int) -> None:
        self.session = session
        self.outstanding = 0
        self._held = None
        if self.input is not None:  # closed first: its 'closed' flag must not land after the new attach
            if self.cuda:
                self._unpin(self.input)
            self.input.close()
            self.input = None
        self.input = TensorChannel.attach(input_channel)
        if self.cuda:
            self._pin(self.input)

    # ---- out ------------------------------------------------------------------------------------
    def send(self, msg: QKVHandoff) -> None:
        tensors = msg.tensors()
        meta = msg.header.pack()
        if not self.cuda:
            self.output.send(meta, tensors, timeout=self.timeout)
            HANDOFF_WORK.labels("out").inc(self.output.last_work_ns / 1e9)
        else:  # the copy and the post happen off this thread: there is no host work to count
            self._send_async(meta, tensors)
        self.outstanding += 1
        HANDOFFS.labels("out").inc()

    def send_release(self, step: int, seq_ids: list[int]) -> None:
        """A step's finished sequences, ahead of its first hand-off; attention sends no reply."""
        if self.cuda:
            self._publisher.flush()  # slots post in order: none may still wait behind this send
        for msg in ReleaseHandoff.chunks(step, self.session, seq_ids, self.output.slot_bytes):
            self.output.send(msg.header.pack(), msg.tensors(), timeout=self.timeout)
            HANDOFFS.labels("release").inc()

    def _send_async(self, meta: bytes, tensors: list[torch.Tensor]) -> None:
        slot = self.output.reserve([(t.dtype, tuple(t.shape)) for t in tensors], timeout=self.timeout)
        try:
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._d2h):
                self._d2h.wait_event(produced)
                for dst, src in zip(slot.tensors, tensors, strict=True):
                    dst.copy_(src, non_blocking=True)
                    if src.is_cuda:
                        src.record_stream(self._d2h)  # the allocator must not reuse it before the copy ran
                done = torch.cuda.Event(blocking=True)  # the publisher sleeps on it: no core spins
                done.record(self._d2h)
            self._publisher.put(done, slot, meta)
        except BaseException:
            self.output.unreserve(slot)  # nothing queued for it: the next message takes its place
            raise

    # ---- in -------------------------------------------------------------------------------------
    def receive(self, step: int, layer: int, micro_batch: int) -> tuple[torch.Tensor, int]:
        """The attention result of (step, layer, micro-batch) on the device, (T, H * Hd), and the
        attention service's compute for it in ns (the HRM's attention row: the wait here shows only
        what this side's other micro-batches did not hide)."""
        assert self.input is not None
        self._release_held()
        msg = AttentionHandoff.decode(*self.input.recv(timeout=self.timeout))
        while msg.header.session != self.session:  # left over from a session before a restart
            self.input.release()
            self.log.warning("stale_handoff_dropped", step=msg.header.step, layer=msg.header.layer)
            msg = AttentionHandoff.decode(*self.input.recv(timeout=self.timeout))
        self.outstanding -= 1
        HANDOFFS.labels("in").inc()
        HANDOFF_LATENCY.labels("in").inc(self.input.last_latency_ns / 1e9)
        HANDOFF_WORK.labels("in").inc(self.input.last_work_ns / 1e9)
        _check(msg, (step, layer, micro_batch))
        assert msg.out is not None
        if not self.cuda:
            return msg.out, msg.busy_ns  # a view of the slot, valid until done_with_input
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._h2d):
            out = torch.empty(msg.out.shape, dtype=msg.out.dtype, device=self.device)
            out.copy_(msg.out, non_blocking=True)
            ready = torch.cuda.Event(blocking=True)  # waited on only if still copying: sleep, never spin
            ready.record(self._h2d)
        compute.wait_event(ready)
        out.record_stream(compute)
        self._held = ready
        return out, msg.busy_ns

    def done_with_input(self) -> None:
        """The last result is no longer read from its slot (CPU: post-attention has run on it)."""
        if not self.cuda and self.input is not None:
            self.input.release()

    def _release_held(self) -> None:
        """Hands the last result's slot back once its copy to the device is done: issued a micro-batch
        ago on a stream of its own, it is done by now but for a slow link, so the host asks (no
        synchronisation) and waits, asleep, only then (a wait per receive kept the host from running
        ahead of the device)."""
        if self._held is not None and self.input is not None:
            if not self._held.query():
                self._held.synchronize()
            self._held = None
            self.input.release()

    def end_step(self) -> None:
        self._release_held()

    def drain(self) -> None:
        """After a failure: let queued sends land and consume the results still owed, so the next
        step starts clean."""
        if self.cuda:
            try:
                self._publisher.flush()
            except BaseException as exc:
                self.log.warning("handoff_publish_failed", error=str(exc))
                self._publisher.error = None
        self._release_held()
        if self.input is None:
            return
        for _ in range(self.outstanding):
            try:
                self.input.recv(timeout=5.0)
                self.input.release()
            except (ChannelTimeoutError, ChannelClosedError, PeerDiedError):
                break
        self.outstanding = 0

    def close(self, unpin: bool = True) -> None:
        """`unpin=False`: a step may still be copying; the registrations end with the process."""
        if self.cuda:
            self._publisher.close()
        if unpin:
            for buffer in self._pinned:
                unpin_host_memory(buffer, self.device)
        self._pinned.clear()
        if self.input is not None:
            self.input.close()
        self.output.close()


def _check(msg: AttentionHandoff, expected: tuple[int, int, int]) -> None:
    if msg.header.status:
        code = msg.header.status_code
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise KVCacheFullError(msg.error)
        raise ServiceError(f"attention failed: {msg.error}", code)
    if msg.header.key != expected:
        raise ServiceError(f"hand-off out of order: expected {expected}, got {msg.header.key}")
