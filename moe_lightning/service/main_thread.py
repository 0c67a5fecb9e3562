"""Work handed from gRPC's handler threads to the process's main thread, which runs it.

Why the main thread: libgomp keeps one team of OpenMP threads per thread that starts parallel regions
(how PyTorch and the native kernels use more than one core), and once a process has more such threads
than cores it stops letting them spin between regions: every region then pays a sleep and a wake-up
(a PyTorch op on a few rows, one or two regions, took 48 us instead of 16 with a second team alive,
measured here). A decode step of the `bench` model on a CPU starts ~800 regions; steps that ran on
whichever gRPC thread took the call left a team behind on each (docs/operations.md, "Threads").
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class ServiceStoppingError(RuntimeError):
    """Work handed over after the main thread stopped taking it."""


class MainThreadWork:
    """`run(fn)` from any thread returns fn() as run by `serve(stopped)`, the main thread's loop until
    `stopped` is set (directly where no loop serves yet, or when called on the loop's thread). Work
    handed over once the loop ends fails with ServiceStoppingError rather than waiting for ever."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], object], Future[object]]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # a hand-over and the loop's end: none slips in between
        self._closed = False
        self._serving = False
        self._thread: threading.Thread | None = None

    def run(self, fn: Callable[[], T]) -> T:
        future: Future[object] = Future()
        with self._lock:
            if self._closed:
                raise ServiceStoppingError("the service is stopping: its main thread takes no more work")
            direct = not self._serving or threading.current_thread() is self._thread
            if not direct:
                self._queue.put((fn, future))
        if direct:  # before the loop starts (start-up), or on its own thread
            return fn()
        return future.result()  # type: ignore[return-value]

    def serve(self, stopped: threading.Event, poll_seconds: float = 0.5) -> None:
        with self._lock:
            self._serving, self._thread = True, threading.current_thread()
        while not stopped.is_set():
            try:
                fn, future = self._queue.get(timeout=poll_seconds)
            except queue.Empty:
                continue
            self._execute(fn, future)
        with self._lock:
            self._closed = True
        while True:
            try:
                _, future = self._queue.get_nowait()
            except queue.Empty:
                return
            future.set_exception(ServiceStoppingError("the service stopped before this work ran"))

    @staticmethod
    def _execute(fn: Callable[[], object], future: Future[object]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except Exception as exc:  # the caller's: it re-raises in the handler thread that handed it over
            future.set_exception(exc)
