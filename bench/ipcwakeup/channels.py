"""One wake-up channel per mechanism, each a pair of one-way signals between side A and side B.

owner=True is side A (creates the named objects and unlinks them), owner=False is side B (opens
them by name). wait() returns "ok", "timeout" or "eof" (the mechanism itself reported the peer
gone); it never blocks longer than its timeout, so a dead peer can always be noticed.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import struct
import time
from typing import Any

from bench.ipcwakeup.common import RT_BUDGET_S, TMPDIR


class Channel:
    def __init__(self, name: str, owner: bool) -> None:
        self.name = name
        self.owner = owner

    def signal(self) -> None:
        raise NotImplementedError

    def wait(self, timeout_s: float) -> str:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class SemChannel(Channel):
    def __init__(self, name: str, owner: bool) -> None:
        super().__init__(name, owner)
        import posix_ipc

        self._busy = posix_ipc.BusyError
        self._sigerr = posix_ipc.SignalError
        self._ipc = posix_ipc
        names = (f"/{name}-ab", f"/{name}-ba")
        self._names = names
        self._sems: list[Any] = []
        flags = posix_ipc.O_CREX if owner else 0
        for n in names:
            self._sems.append(posix_ipc.Semaphore(n, flags, initial_value=0))
        self._tx, self._rx = (self._sems[0], self._sems[1]) if owner else (self._sems[1], self._sems[0])

    def signal(self) -> None:
        self._tx.release()

    def wait(self, timeout_s: float) -> str:
        try:
            self._rx.acquire(timeout_s)
        except (self._busy, self._sigerr):  # SignalError: EINTR, let the Python handler run next
            return "timeout"
        return "ok"

    def close(self) -> None:
        for s in self._sems:
            with contextlib.suppress(Exception):
                s.close()
        if self.owner:
            for n in self._names:
                with contextlib.suppress(self._ipc.ExistentialError):
                    self._ipc.unlink_semaphore(n)


class ZmqChannel(Channel):
    def __init__(self, name: str, owner: bool) -> None:
        super().__init__(name, owner)
        import zmq

        self._zmq = zmq
        self.path = os.path.join(TMPDIR, f"{name}.sock")
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDTIMEO, int(RT_BUDGET_S * 1000))
        if owner:
            self._sock.bind(f"ipc://{self.path}")
        else:
            self._sock.connect(f"ipc://{self.path}")

    def signal(self) -> None:
        self._sock.send(b"x")

    def wait(self, timeout_s: float) -> str:
        if self._sock.poll(int(timeout_s * 1000), self._zmq.POLLIN):
            self._sock.recv()
            return "ok"
        return "timeout"

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._sock.close(linger=0)
        with contextlib.suppress(Exception):
            self._ctx.term()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class FifoChannel(Channel):
    """Two FIFOs. Opening order avoids the blocking open(): A opens its read end before starting B,
    B opens its read end and then its write end (A's reader exists), B's first signal tells A that
    B's reader exists, and A opens its write end lazily on its first signal()."""

    def __init__(self, name: str, owner: bool) -> None:
        super().__init__(name, owner)
        self._paths = (os.path.join(TMPDIR, f"{name}.ab"), os.path.join(TMPDIR, f"{name}.ba"))
        self._tx_fd = -1
        self._rx_fd = -1
        if owner:
            for p in self._paths:
                os.mkfifo(p, 0o600)
            self._tx_path, rx_path = self._paths
            self._rx_fd = os.open(rx_path, os.O_RDONLY | os.O_NONBLOCK)
        else:
            rx_path, self._tx_path = self._paths
            self._rx_fd = os.open(rx_path, os.O_RDONLY | os.O_NONBLOCK)
            self._tx_fd = os.open(self._tx_path, os.O_WRONLY | os.O_NONBLOCK)
        self._ever_read = False

    def signal(self) -> None:
        if self._tx_fd < 0:
            self._tx_fd = os.open(self._tx_path, os.O_WRONLY | os.O_NONBLOCK)
        os.write(self._tx_fd, b"x")

    def wait(self, timeout_s: float) -> str:
        r, _, _ = select.select([self._rx_fd], [], [], timeout_s)
        if not r:
            return "timeout"
        try:
            data = os.read(self._rx_fd, 4096)
        except BlockingIOError:
            return "timeout"
        if data:
            self._ever_read = True
            return "ok"
        if not self._ever_read:  # no writer connected yet (start-up); not a death
            time.sleep(0.001)
            return "timeout"
        return "eof"  # all writers closed: the kernel closed the dead peer's write end

    def close(self) -> None:
        for fd in (self._tx_fd, self._rx_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if self.owner:
            for p in self._paths:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)


class SpinChannel(Channel):
    """Each side owns one 64-bit counter (on separate cache lines) and bumps it to signal; the
    other side spins until the counter changes. Deadline is checked every 256 polls."""

    def __init__(self, name: str, owner: bool) -> None:
        super().__init__(name, owner)
        import posix_ipc

        self._ipc = posix_ipc
        self._shm_name = f"/{name}-spin"
        if owner:
            shm = posix_ipc.SharedMemory(self._shm_name, posix_ipc.O_CREX, size=128)
        else:
            shm = posix_ipc.SharedMemory(self._shm_name)
        self._mm = mmap.mmap(shm.fd, 128)
        shm.close_fd()
        self._tx_off, self._rx_off = (0, 64) if owner else (64, 0)
        self._tx_seq = 0
        self._rx_seen = struct.unpack_from("<Q", self._mm, self._rx_off)[0]

    def signal(self) -> None:
        self._tx_seq += 1
        struct.pack_into("<Q", self._mm, self._tx_off, self._tx_seq)

    def wait(self, timeout_s: float) -> str:
        mm, off, seen, unpack = self._mm, self._rx_off, self._rx_seen, struct.unpack_from
        deadline = time.monotonic() + timeout_s
        while True:
            for _ in range(256):
                v = unpack("<Q", mm, off)[0]
                if v != seen:
                    self._rx_seen = v
                    return "ok"
            if time.monotonic() >= deadline:
                return "timeout"

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._mm.close()
        if self.owner:
            with contextlib.suppress(self._ipc.ExistentialError):
                self._ipc.unlink_shared_memory(self._shm_name)


class Iox2Channel(Channel):
    def __init__(self, name: str, owner: bool) -> None:
        super().__init__(name, owner)
        import iceoryx2 as iox2

        iox2.set_log_level(iox2.LogLevel.Error)
        self._iox2 = iox2
        node_name = f"{name}-{'a' if owner else 'b'}"
        self._node = (
            iox2.NodeBuilder.new()
            .name(iox2.NodeName.new(node_name))
            .signal_handling_mode(iox2.SignalHandlingMode.Disabled)
            .create(iox2.ServiceType.Ipc)
        )
        ab = self._node.service_builder(iox2.ServiceName.new(f"{name}-ab")).event().open_or_create()
        ba = self._node.service_builder(iox2.ServiceName.new(f"{name}-ba")).event().open_or_create()
        tx_svc, rx_svc = (ab, ba) if owner else (ba, ab)
        self._services = [ab, ba]
        self.stale_nodes_cleaned: int | None = None
        self._listener = rx_svc.listener_builder().create()
        self._notifier = tx_svc.notifier_builder().create()

    def signal(self) -> None:
        self._notifier.notify()

    def wait(self, timeout_s: float) -> str:
        got = self._listener.timed_wait(self._iox2.Duration.from_micros(max(1, int(timeout_s * 1e6))))
        return "ok" if got else "timeout"

    def close(self) -> None:
        for port in (self._notifier, self._listener):
            with contextlib.suppress(Exception):
                port.delete()
        self._services.clear()
        if self.owner:  # remove what a SIGKILLed peer node left behind (not done by the kernel)
            with contextlib.suppress(Exception):
                self.stale_nodes_cleaned = self._node.try_cleanup_dead_nodes().cleanups
        with contextlib.suppress(Exception):
            del self._node


CHANNELS: dict[str, type[Channel]] = {
    "sem": SemChannel,
    "zmq": ZmqChannel,
    "fifo": FifoChannel,
    "spin": SpinChannel,
    "iox2": Iox2Channel,
}
