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
    """`run(fn)` from any thread returns fn() as run by `serve()`, the main thread's loop until
    `close()` (directly where no loop serves yet, or when called on the loop's thread). Work handed
    over once `close()` was called fails with ServiceStoppingError rather than waiting for ever.

    The loop blocks in a queue get with no timeout and `close()` wakes it: CPython 3.11's
    SimpleQueue.get(timeout=...) waits for ever when a signal handler runs past its deadline (it
    retries with a negative timeout, which means none), and SIGTERM is how a service is stopped
    (CI: a service that had logged service_stopped never exited)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], object], Future[object]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # a hand-over and close(): none slips in between
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

    def serve(self) -> None:
        """Runs the work handed over until close(); returns at once if it was already called."""
        with self._lock:
            self._serving, self._thread = True, threading.current_thread()
        while (item := self._queue.get()) is not None:
            fn, future = item
            if self._closed:  # handed over before close(), after the service's clean-up: not run
                future.set_exception(ServiceStoppingError("the service stopped before this work ran"))
            else:
                self._execute(fn, future)

    def close(self) -> None:
        """Ends serve(); what was handed over and not yet run fails with ServiceStoppingError. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)  # after every hand-over: run() puts only while not closed, under the lock

    @staticmethod
    def _execute(fn: Callable[[], object], future: Future[object]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except Exception as exc:  # the caller's: it re-raises in the handler thread that handed it over
            future.set_exception(exc)
