"""The heartbeat of channel ends: one daemon thread per process stamps the monotonic clock into
every live end, so that a peer can tell a process gone or hung from one that is merely idle."""

from __future__ import annotations

import threading
import time
import weakref
from typing import Protocol

HEARTBEAT_SECONDS = 0.1


class Beating(Protocol):
    def _beat(self) -> None: ...


class Heartbeats:
    def __init__(self) -> None:
        self._ends: weakref.WeakSet[Beating] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, end: Beating) -> None:
        with self._lock:
            self._ends.add(end)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="shm-heartbeat", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                ends = list(self._ends)
            for end in ends:
                end._beat()
            del ends
            time.sleep(HEARTBEAT_SECONDS)


HEARTBEATS = Heartbeats()
