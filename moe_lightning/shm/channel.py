"""A one-writer, one-reader channel of tensor messages in shared memory.

Fixed slots in one segment (vLLM's shm_broadcast shape): the writer lays its tensors out in the
next free slot, fills them, writes the slot's binary header, then posts a named semaphore; the
reader waits on it, gets zero-copy views, and releases the slot when done. Both ends find the
channel by name (the services start as unrelated processes), and every wait has a timeout and
watches the peer's heartbeat, so a `kill -9` on one side becomes an error on the other instead of
a hang. What a message's header bytes mean is the caller's business (`moe_lightning/handoff.py`
for the hand-offs); the channel only carries them.

Segment layout::

    +-------------------+  0
    | channel header    |  u64 fields: magic, slots, slot_bytes, pids, heartbeats, closed flags,
    | (HEADER_BYTES)    |  read_index, reader_holding, publishing_index, published_index (_FIELDS)
    +-------------------+  HEADER_BYTES
    | slot 0 meta       |  u32 meta_len | u32 num_tensors | u64 sent_ns
    | (SLOT_META_BYTES) |  num_tensors x (u8 dtype, u8 ndim, u16 -, u32 -, u64 offset, u64 shape[4])
    |                   |  meta bytes (the caller's header)
    +-------------------+
    | slot 0 data       |  the tensors, each at a 64-byte aligned offset
    | (slot_bytes)      |
    +-------------------+
    | slot 1 meta ...   |  slots used round-robin: message i lives in slot i % slots
    +-------------------+

A writer may reserve several slots before it publishes them (a CUDA writer fills them with
asynchronous copies); slots are published, and therefore read, in the order they were reserved.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import posix_ipc
import torch

from moe_lightning.shm.heartbeats import HEARTBEATS
from moe_lightning.shm.pages import SEMAPHORE_BYTES, no_space_as_full
from moe_lightning.shm.segment import Segment

MAGIC = 0x4D4C54_43484E33  # "MLTCHN3": binary slot headers, the writer's indices in the header
HEADER_BYTES = 4096
SLOT_META_BYTES = 1024
ALIGN = 64
MAX_DIMS = 4
_SLOT_HEAD = struct.Struct("<IIQ")  # meta_len, num_tensors, sent_ns
_ENTRY = struct.Struct("<BBHIQ4Q")  # dtype code, ndim, -, -, offset, shape (zero-padded)
MAX_TENSORS = 8
MAX_META_BYTES = SLOT_META_BYTES - _SLOT_HEAD.size - MAX_TENSORS * _ENTRY.size
# header fields, u64 each; a re-attaching reader resets its own fields, so a restarted peer can join,
# and resumes where its predecessor's reads actually got to (see _resync; the writer is always the
# creator: a restarted writer makes a new channel)
_FIELDS = (
    "magic",
    "slots",
    "slot_bytes",
    "writer_pid",
    "reader_pid",
    "writer_beat",
    "reader_beat",
    "writer_closed",
    "reader_closed",
    "read_index",  # messages the readers released so far
    "reader_holding",  # 1 while a reader holds a received, unreleased slot
    "publishing_index",  # messages the writer started publishing (set before the post)
    "published_index",  # messages the writer posted (set after the post)
)
_OFF = {name: 8 * i for i, name in enumerate(_FIELDS)}
WAIT_SLICE_SECONDS = 0.05
SPIN_SECONDS = 100e-6  # poll this long before sleeping on the semaphore: a hand-off is often imminent

DTYPE_CODES: dict[torch.dtype, int] = {
    d: i + 1
    for i, d in enumerate(
        (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool)
    )
}
_DTYPES = {code: d for d, code in DTYPE_CODES.items()}


class ChannelClosedError(RuntimeError):
    """The peer closed the channel."""


class PeerDiedError(RuntimeError):
    """The peer stopped beating: its process is gone or hung."""


class ChannelTimeoutError(TimeoutError):
    """Nothing arrived (or no slot freed) within the timeout."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


TensorLayout = tuple[torch.dtype, tuple[int, ...]]


@dataclass(slots=True)
class OutgoingSlot:
    """A reserved slot: fill `tensors` (views into shared memory), then `publish` it."""

    index: int  # the message number (the slot is index % slots)
    tensors: list[torch.Tensor]
    table: list[tuple[int, int, tuple[int, ...], int]]  # (dtype code, ndim, shape, offset)


class TensorChannel:
    """Create with `create()` (the writer, which owns and unlinks) or `attach()` (the reader)."""

    def __init__(self, segment: Segment, is_writer: bool, dead_after: float) -> None:
        self.segment = segment
        self.name = segment.name
        self.is_writer = is_writer
        self.dead_after = dead_after
        self._mm = segment.buf
        if self._get("magic") != MAGIC:
            raise ValueError(f"{self.name} is not a tensor channel (or one of another version)")
        self.slots = self._get("slots")
        self.slot_bytes = self._get("slot_bytes")
        flags = posix_ipc.O_CREX if is_writer and segment.created else 0
        try:
            self._items = posix_ipc.Semaphore(self.name + ".items", flags, initial_value=0)
            self._spaces = posix_ipc.Semaphore(self.name + ".spaces", flags, initial_value=self.slots)
        except posix_ipc.ExistentialError:
            raise FileNotFoundError(f"semaphores of channel {self.name} do not exist") from None
        except OSError as exc:  # a semaphore is a file in /dev/shm too: a full one refuses it
            raise no_space_as_full(exc, f"a semaphore of channel {self.name}", SEMAPHORE_BYTES) from None
        self._next_write = 0  # the next message to reserve
        self._next_publish = 0  # the next reserved message to publish
        self._next_read = 0 if is_writer else self._resync()
        self._pending_release = False
        self._closed = False
        self.last_latency_ns = 0  # publish-to-receive time of the last message received (same clock)
        self.last_work_ns = 0  # CPU time of the last send() or recv() itself, waiting excluded
        me, peer = ("writer", "reader") if is_writer else ("reader", "writer")
        self._role_pid, self._role_beat, self._role_closed = f"{me}_pid", f"{me}_beat", f"{me}_closed"
        self._peer_pid, self._peer_beat, self._peer_closed = f"{peer}_pid", f"{peer}_beat", f"{peer}_closed"
        self._set(self._role_closed, 0)
        self._set(self._role_pid, os.getpid())
        self._beat()
        HEARTBEATS.add(self)

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, slots: int, slot_bytes: int, dead_after: float = 1.5) -> TensorChannel:
        if slots <= 0 or slot_bytes <= 0:
            raise ValueError("slots and slot_bytes must be positive")
        slot_bytes = _align(slot_bytes)
        segment = Segment.create(name, HEADER_BYTES + slots * (SLOT_META_BYTES + slot_bytes), f"channel {name}")
        struct.pack_into("<QQQ", segment.buf, 0, MAGIC, slots, slot_bytes)
        try:
            return cls(segment, is_writer=True, dead_after=dead_after)
        except BaseException:  # its semaphores could not be made (a full /dev/shm): nothing stays behind
            segment.close()
            segment.unlink()
            _unlink_semaphores(name)
            raise

    @classmethod
    def attach(cls, name: str, dead_after: float = 1.5) -> TensorChannel:
        return cls(Segment.attach(name), is_writer=False, dead_after=dead_after)

    def _taken(self) -> int | None:
        """Messages readers took off the items semaphore so far (posts - its value), or None if unknown.

        A seqlock on the writer's indices: `published_index` is stored after each post, `publishing_index`
        before it, so equal values read around the semaphore's value mean the posts then were exactly that.
        """
        if not posix_ipc.SEMAPHORE_VALUE_SUPPORTED:
            return None
        for _ in range(10_000):
            done = self._get("published_index")
            value = self._items.value
            if self._get("publishing_index") == done:
                return done - value
            time.sleep(0)
        return None  # the writer died mid-publish (or is very slow): fall back to the holding flag

    def _resync(self) -> int:
        """A new reader's read position: the message after the last one any reader took.

        A reader that died between its sem_wait and storing `reader_holding` took a message without
        a trace in the header; trusting `read_index` alone would make its successor re-read that
        stale slot and stay one message behind for good. Messages taken but never released are
        skipped, and their slots given back, or the semaphores and the read position disagree.
        """
        released = self._get("read_index")
        taken = self._taken()
        if taken is None or taken < released:
            taken = released + (1 if self._get("reader_holding") else 0)
        for _ in range(taken - released):
            self._spaces.release()
        self._set("read_index", taken)
        self._set("reader_holding", 0)
        return taken

    # ---- header access --------------------------------------------------------------------------
    def _get(self, field: str) -> int:
        return struct.unpack_from("<Q", self._mm, _OFF[field])[0]

    def _set(self, field: str, value: int) -> None:
        struct.pack_into("<Q", self._mm, _OFF[field], value)

    def _beat(self) -> None:
        if not self._closed:
            try:
                self._set(self._role_beat, time.monotonic_ns())
            except (ValueError, TypeError):
                pass  # mapping already closed

    def peer_alive(self) -> bool:
        if self._get(self._peer_pid) == 0:
            return True  # not attached yet: nothing to judge
        age = (time.monotonic_ns() - self._get(self._peer_beat)) / 1e9
        return age < self.dead_after

    def _wait(self, sem: posix_ipc.Semaphore, timeout: float, what: str) -> None:
        spin_until = time.perf_counter() + SPIN_SECONDS
        while True:
            try:
                sem.acquire(0)
                return
            except posix_ipc.BusyError:
                if time.perf_counter() >= spin_until:
                    break
        deadline = time.monotonic() + timeout
        while True:
            try:
                sem.acquire(WAIT_SLICE_SECONDS)
                return
            except posix_ipc.BusyError:
                pass
            except posix_ipc.SignalError:  # a signal reached this thread (SIGTERM goes to the main one,
                pass  # which runs the steps): its handler runs, and a hand-off under way is not lost to it
            if self._get(self._peer_closed):
                raise ChannelClosedError(f"channel {self.name} was closed by its peer")
            if not self.peer_alive():
                raise PeerDiedError(f"the peer of channel {self.name} stopped responding (process gone?)")
            if time.monotonic() >= deadline:
                raise ChannelTimeoutError(f"{what} on channel {self.name} timed out after {timeout:.1f} s")

    # ---- data -----------------------------------------------------------------------------------
    def _slot_offset(self, index: int) -> int:
        return HEADER_BYTES + (index % self.slots) * (SLOT_META_BYTES + self.slot_bytes)

    def reserve(self, layouts: Sequence[TensorLayout], timeout: float = 30.0) -> OutgoingSlot:
        """Waits for a free slot and lays out tensors of these (dtype, shape) in it."""
        if not self.is_writer:
            raise RuntimeError("reserve() on the reading end")
        if len(layouts) > MAX_TENSORS:
            raise ValueError(f"a message holds at most {MAX_TENSORS} tensors, got {len(layouts)}")
        table, offset = [], 0
        for dtype, shape in layouts:
            if len(shape) > MAX_DIMS:
                raise ValueError(f"a tensor in a message has at most {MAX_DIMS} dimensions, got shape {tuple(shape)}")
            if dtype not in DTYPE_CODES:
                raise ValueError(f"dtype {dtype} cannot go through a channel")
            numel = 1
            for s in shape:
                numel *= int(s)
            table.append((DTYPE_CODES[dtype], len(shape), tuple(int(s) for s in shape), offset))
            offset = _align(offset + numel * dtype.itemsize)
        if offset > self.slot_bytes:
            raise ValueError(f"message of {offset} bytes exceeds the slot size {self.slot_bytes} of {self.name}")
        self._wait(self._spaces, timeout, "waiting for a free slot")
        index = self._next_write
        self._next_write += 1
        base = self._slot_offset(index) + SLOT_META_BYTES
        views = [self.segment.tensor(base + off, _DTYPES[code], shape) for code, _, shape, off in table]
        return OutgoingSlot(index, views, table)

    def publish(self, slot: OutgoingSlot, meta: bytes) -> None:
        """Makes a filled slot visible to the reader (slots publish in the order they were reserved)."""
        if slot.index != self._next_publish:
            raise RuntimeError(f"slot {slot.index} published out of order (next is {self._next_publish})")
        if len(meta) > MAX_META_BYTES:
            raise ValueError(f"message header of {len(meta)} bytes exceeds {MAX_META_BYTES}")
        base = self._slot_offset(slot.index)
        pos = base + _SLOT_HEAD.size
        for code, ndim, shape, off in slot.table:
            _ENTRY.pack_into(self._mm, pos, code, ndim, 0, 0, off, *shape, *(0,) * (MAX_DIMS - ndim))
            pos += _ENTRY.size
        self._mm[pos : pos + len(meta)] = meta
        # stamped last: the reader's latency is then the hand-off itself (wake-up included)
        _SLOT_HEAD.pack_into(self._mm, base, len(meta), len(slot.table), time.perf_counter_ns())
        self._next_publish += 1
        # around the post, so a reader attaching now can tell how many messages were taken (_taken)
        self._set("publishing_index", self._next_publish)
        self._items.release()
        self._set("published_index", self._next_publish)

    def unreserve(self, slot: OutgoingSlot) -> None:
        """Gives back the newest reserved slot unpublished (its filling failed)."""
        if slot.index != self._next_write - 1 or slot.index < self._next_publish:
            raise RuntimeError(f"only the newest unpublished slot can be given back, not {slot.index}")
        self._next_write -= 1
        self._spaces.release()

    def send(self, meta: bytes, tensors: Sequence[torch.Tensor] = (), timeout: float = 30.0) -> None:
        """Copies `tensors` into the next slot (from any device, synchronously) and publishes it."""
        slot = self.reserve([(t.dtype, tuple(t.shape)) for t in tensors], timeout)
        t0 = time.perf_counter_ns()
        try:
            for dst, src in zip(slot.tensors, tensors, strict=True):
                dst.copy_(src)
            self.publish(slot, meta)
        except BaseException:
            self.unreserve(slot)
            raise
        self.last_work_ns = time.perf_counter_ns() - t0

    def recv(self, timeout: float = 30.0) -> tuple[bytes, list[torch.Tensor]]:
        """The next message: (header bytes, zero-copy tensor views). Views are valid until `release()`."""
        if self.is_writer:
            raise RuntimeError("recv() on the writing end")
        if self._pending_release:
            self.release()
        self._wait(self._items, timeout, "waiting for a message")
        t0 = time.perf_counter_ns()
        base = self._slot_offset(self._next_read)
        meta_len, num_tensors, sent_ns = _SLOT_HEAD.unpack_from(self._mm, base)
        pos = base + _SLOT_HEAD.size
        tensors = []
        for _ in range(num_tensors):
            code, ndim, _, _, off, *shape = _ENTRY.unpack_from(self._mm, pos)
            tensors.append(self.segment.tensor(base + SLOT_META_BYTES + off, _DTYPES[code], tuple(shape[:ndim])))
            pos += _ENTRY.size
        meta = bytes(self._mm[pos : pos + meta_len])
        self._pending_release = True
        self._set("reader_holding", 1)
        now = time.perf_counter_ns()
        self.last_latency_ns = now - sent_ns
        self.last_work_ns = now - t0
        return meta, tensors

    def release(self) -> None:
        """Hands the last received slot back to the writer."""
        if self._pending_release:
            self._pending_release = False
            self._next_read += 1
            self._set("read_index", self._next_read)
            self._set("reader_holding", 0)
            self._spaces.release()

    # ---- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        try:
            self._set(self._role_closed, 1)
        except (ValueError, TypeError):
            pass
        self._closed = True
        for sem in (self._items, self._spaces):
            sem.close()
        self.segment.close()
        if self.is_writer and self.segment.created:
            self.segment.unlink()
            _unlink_semaphores(self.name)

    def __enter__(self) -> TensorChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unlink_semaphores(name: str) -> None:
    for suffix in (".items", ".spaces"):
        try:
            posix_ipc.unlink_semaphore(name + suffix)
        except posix_ipc.ExistentialError:
            pass
