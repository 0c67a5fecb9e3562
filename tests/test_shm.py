"""The data plane between real processes: channels, dead-peer detection, segment sweeping."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from moe_lightning.shm.channel import PeerDiedError, TensorChannel
from moe_lightning.shm.segment import Segment, list_segments, segment_name, sweep_stale

ECHO_PEER = textwrap.dedent(
    """
    import sys, time
    from moe_lightning.shm.channel import TensorChannel
    from moe_lightning.shm.segment import segment_name
    inp = TensorChannel.attach(sys.argv[1])
    out = TensorChannel.create(segment_name(sys.argv[2], "peer", "rep"), 2, 1 << 16)
    print(out.name, flush=True)
    while True:
        meta, ts = inp.recv(timeout=30)
        if meta == b"stop":
            break
        reply = [t * 2 for t in ts]
        inp.release()
        out.send(b"echo " + meta, reply)
    time.sleep(0.5)
    out.close()
    inp.close()
    """
)


def _start_echo(run: str) -> tuple[TensorChannel, subprocess.Popen[str], str]:
    a = TensorChannel.create(segment_name(run, "test", "req"), 2, 1 << 16)
    proc = subprocess.Popen([sys.executable, "-c", ECHO_PEER, a.name, run], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return a, proc, proc.stdout.readline().strip()


def test_round_trip_between_processes_keeps_dtype_shape_and_order() -> None:
    run = f"t{os.getpid()}"
    a, proc, b_name = _start_echo(run)
    b = TensorChannel.attach(b_name)
    try:
        for i in range(20):
            x = torch.randn(i + 1, 3, 4)
            y = torch.arange(i + 2, dtype=torch.int64)
            a.send(str(i).encode(), [x, y])
            meta, (x2, y2) = b.recv(timeout=10)
            assert meta == f"echo {i}".encode()
            assert x2.dtype == torch.float32 and y2.dtype == torch.int64
            torch.testing.assert_close(x2, x * 2)
            torch.testing.assert_close(y2, y * 2)
            b.release()
        a.send(b"stop")
        assert proc.wait(10) == 0
    finally:
        a.close()
        b.close()
        proc.kill()
    assert list_segments(run) == []


def test_oversized_message_is_refused_before_blocking() -> None:
    with (
        TensorChannel.create(segment_name(f"t{os.getpid()}", "test", "small"), 1, 1024) as ch,
        pytest.raises(ValueError, match="exceeds the slot size"),
    ):
        ch.send(b"", [torch.zeros(1024)])


def test_kill_9_of_the_peer_becomes_an_error_not_a_hang() -> None:
    run = f"k{os.getpid()}"
    a, proc, b_name = _start_echo(run)
    b = TensorChannel.attach(b_name)
    try:
        a.send(b"0", [torch.ones(2)])
        b.recv(timeout=10)
        b.release()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        with pytest.raises(PeerDiedError):
            b.recv(timeout=30)  # nothing will ever come; the heartbeat says why
        assert time.monotonic() - t0 < 3.0
    finally:
        a.close()
        b.close()
    # the dead peer's segment and semaphores are still there until swept
    assert any(".peer." in n for n in list_segments(run))
    swept = sweep_stale(run)
    assert any(".peer." in n for n in swept)
    assert list_segments(run) == []


def test_sweep_leaves_live_owners_alone() -> None:
    run = f"s{os.getpid()}"
    live = Segment.create(segment_name(run, "live", "x"), 4096)
    dead_name = segment_name(run, "dead", "x", pid=2**22 - 1)  # no such pid
    Segment.create(dead_name, 4096).close()
    try:
        assert sweep_stale(run) == [dead_name.lstrip("/")]
        assert list_segments(run) == [live.name.lstrip("/")]
    finally:
        live.close()
        live.unlink()


def test_segment_names_are_checked() -> None:
    with pytest.raises(ValueError, match="run_id may only hold"):
        segment_name("a.b", "owner", "x")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Segment.attach("/mlt.none.none.1.none")


@pytest.mark.parametrize("held", [False, True])
def test_a_new_reader_resumes_where_the_last_one_stopped(held: bool) -> None:
    """A restarted reader picks up at the shared read position; a slot its predecessor died holding
    is given back, so reads stay in order and nothing blocks."""
    name = segment_name(f"resume{os.getpid()}{int(held)}", "test", "ch")
    writer = TensorChannel.create(name, slots=4, slot_bytes=1024)
    try:
        for i in range(4):  # the ring is full
            writer.send(bytes([i]), [torch.full((2,), float(i))])
        first = TensorChannel.attach(name)
        assert first.recv(timeout=5)[0] == bytes([0])
        if not held:
            first.release()
        # the first reader is gone (crashed: no close, maybe no release)
        second = TensorChannel.attach(name)
        writer.send(bytes([4]), [torch.full((2,), 4.0)], timeout=5)  # needs the slot back when held
        got = []
        for _ in range(4):
            meta, tensors = second.recv(timeout=5)
            got.append(meta[0])
            assert torch.equal(tensors[0], torch.full((2,), float(meta[0])))
            second.release()
        assert got == [1, 2, 3, 4]
        second.close()
        first.close()
    finally:
        writer.close()


def test_reserved_slots_publish_in_order_and_carry_any_shape() -> None:
    """A writer that fills slots asynchronously reserves several first; they reach the reader in
    reservation order, with every dtype and up to four dimensions, and a slot whose filling failed
    is given back."""
    name = segment_name(f"rsv{os.getpid()}", "test", "ch")
    writer = TensorChannel.create(name, slots=3, slot_bytes=4096)
    reader = TensorChannel.attach(name)
    try:
        shapes = [(torch.float32, (2, 3)), (torch.bfloat16, (1, 2, 3, 4)), (torch.int64, ()), (torch.bool, (5,))]
        a = writer.reserve(shapes)
        b = writer.reserve([(torch.uint8, (7,))])
        with pytest.raises(RuntimeError, match="out of order"):
            writer.publish(b, b"b")
        for i, t in enumerate(a.tensors):
            t.copy_(torch.full(t.shape, i + 1).to(t.dtype))
        writer.publish(a, b"a")
        b.tensors[0].copy_(torch.arange(7, dtype=torch.uint8))
        writer.publish(b, b"b")
        c = writer.reserve([(torch.float16, (1,))])
        writer.unreserve(c)  # the third slot is free again: three more fit without a reader
        meta, got = reader.recv(timeout=5)
        assert meta == b"a" and [(t.dtype, tuple(t.shape)) for t in got] == [(d, s) for d, s in shapes]
        assert [int(t.reshape(-1)[0]) for t in got] == [1, 2, 3, 1]
        meta, got = reader.recv(timeout=5)
        assert meta == b"b" and got[0].tolist() == list(range(7))
        reader.release()
        with pytest.raises(ValueError, match="at most 4 dimensions"):
            writer.reserve([(torch.float32, (1, 1, 1, 1, 1))])
        with pytest.raises(ValueError, match="header of"):
            writer.send(b"x" * 4096, [])
    finally:
        reader.close()
        writer.close()


def test_a_signal_to_the_waiting_thread_does_not_fail_the_receive() -> None:
    """SIGTERM goes to the main thread, which waits on channels during a step; the semaphore wait it
    interrupts used to surface as posix_ipc.SignalError and fail the hand-off under way."""
    run = f"s{os.getpid()}"
    a, proc, b_name = _start_echo(run)
    b = TensorChannel.attach(b_name)
    got: list[object] = []
    old = signal.signal(signal.SIGUSR1, lambda *_: got.append("handler ran"))
    try:

        def receive() -> None:
            try:
                got.append(b.recv(timeout=10)[0])
            except Exception as exc:
                got.append(exc)

        t = threading.Thread(target=receive)
        t.start()
        time.sleep(0.5)  # past the spin: waiting in the semaphore
        signal.pthread_kill(t.ident, signal.SIGUSR1)
        time.sleep(0.3)
        a.send(b"after the signal", [torch.ones(2)])
        t.join(10)
        assert got == ["handler ran", b"echo after the signal"]
    finally:
        signal.signal(signal.SIGUSR1, old)
        a.send(b"stop", [])
        proc.wait(10)
        b.close()
        a.close()
