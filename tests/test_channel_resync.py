"""A reader that dies between its sem_wait and recording that it holds a slot leaves no trace in the
channel header; its successor must still read the next message, not re-read the stale slot for good."""

from __future__ import annotations

import os
import threading

import posix_ipc
import torch

from moe_lightning.shm.channel import TensorChannel
from moe_lightning.shm.segment import segment_name


def _send(writer: TensorChannel, i: int) -> None:
    writer.send(bytes([i]), [torch.full((2,), float(i))], timeout=5)


def test_a_reader_dying_right_after_its_sem_wait_does_not_leave_its_successor_behind() -> None:
    name = segment_name(f"resync{os.getpid()}", "test", "ch")
    writer = TensorChannel.create(name, slots=2, slot_bytes=1024)
    try:
        first = TensorChannel.attach(name)
        _send(writer, 0)
        assert first.recv(timeout=5)[0] == bytes([0])
        first.release()
        _send(writer, 1)
        # the death point: the first reader's sem_wait took message 1, then it died before storing
        # anything (reader_holding, read_index) in the header
        items = posix_ipc.Semaphore(name + ".items")
        items.acquire(0)
        items.close()
        first.close()
        second = TensorChannel.attach(name)
        for i in range(2, 6):  # and the ring keeps turning: message 1's slot was given back
            _send(writer, i)
            meta, tensors = second.recv(timeout=5)
            assert meta == bytes([i]), f"read message {meta[0]} instead of {i}"
            assert torch.equal(tensors[0], torch.full((2,), float(i)))
            second.release()
        second.close()
    finally:
        writer.close()


def test_a_reader_attaching_while_the_writer_publishes_loses_and_repeats_nothing() -> None:
    """The resynchronisation reads the writer's indices around the semaphore's value (a seqlock), so
    a reader that attaches mid-publish starts exactly at the first message nobody took."""
    name = segment_name(f"resyncw{os.getpid()}", "test", "ch")
    writer = TensorChannel.create(name, slots=4, slot_bytes=1024)
    total = 300
    try:
        sender = threading.Thread(target=lambda: [_send(writer, i % 256) for i in range(total)], daemon=True)
        sender.start()
        got: list[int] = []
        while len(got) < total:
            reader = TensorChannel.attach(name)  # a fresh reader per message, attached while sends go on
            got.append(reader.recv(timeout=5)[0][0])
            reader.release()
            reader.close()
        sender.join(5)
        assert got == [i % 256 for i in range(total)]
    finally:
        writer.close()
