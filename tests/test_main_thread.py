"""MainThreadWork (moe_lightning/service/main_thread.py): work handed over from other threads runs on the
thread that serves, results and exceptions go back to the caller, and nothing waits for ever once the
loop ends, a signal arriving while it waits included."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from moe_lightning.service.main_thread import MainThreadWork, ServiceStoppingError


def serving(work: MainThreadWork) -> threading.Thread:
    loop = threading.Thread(target=work.serve, name="serving-loop", daemon=True)
    loop.start()
    return loop


def test_work_from_many_threads_runs_on_the_serving_thread_and_returns_its_results() -> None:
    work = MainThreadWork()
    loop = serving(work)
    try:
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda i: work.run(lambda: (i * i, threading.current_thread().name)), range(200)))
    finally:
        work.close()
        loop.join(5)
    assert [v for v, _ in got] == [i * i for i in range(200)]
    assert {name for _, name in got} == {"serving-loop"}


def test_an_exception_reaches_the_caller_and_the_loop_goes_on() -> None:
    work = MainThreadWork()
    loop = serving(work)

    def fail() -> None:
        raise ValueError("bad step")

    try:
        with ThreadPoolExecutor(1) as pool:
            with pytest.raises(ValueError, match="bad step"):
                pool.submit(work.run, fail).result(5)
            assert pool.submit(work.run, lambda: 7).result(5) == 7
    finally:
        work.close()
        loop.join(5)


def test_before_the_loop_serves_work_runs_in_the_callers_thread() -> None:
    work = MainThreadWork()
    with ThreadPoolExecutor(1) as pool:
        name = pool.submit(work.run, lambda: threading.current_thread().name).result(5)
    assert name != threading.current_thread().name  # the pool's own thread: nothing serves yet


def test_once_the_loop_ends_work_fails_rather_than_waits() -> None:
    work = MainThreadWork()
    loop = serving(work)
    work.close()
    loop.join(5)
    assert not loop.is_alive()
    with ThreadPoolExecutor(1) as pool, pytest.raises(ServiceStoppingError):
        pool.submit(work.run, lambda: 1).result(5)


def test_work_handed_over_before_close_but_not_yet_run_fails_rather_than_runs() -> None:
    """What close() finds queued behind a running step is answered, not run after the clean-up."""
    work = MainThreadWork()
    loop = serving(work)
    started, release = threading.Event(), threading.Event()
    ran = []

    def slow() -> int:
        started.set()
        release.wait(5)
        return 1

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(work.run, slow)
        assert started.wait(5)
        second = pool.submit(work.run, lambda: ran.append(1))
        while work._queue.qsize() == 0:  # the second hand-over is queued behind the running one
            threading.Event().wait(0.01)
        work.close()
        release.set()
        assert first.result(5) == 1
        with pytest.raises(ServiceStoppingError):
            second.result(5)
    loop.join(5)
    assert not loop.is_alive() and ran == []


def test_a_signal_handler_outliving_a_poll_does_not_wedge_the_loop() -> None:
    """The CI failure: SIGTERM's handler ran while the main thread waited for work, past the wait's
    deadline, and CPython 3.11's SimpleQueue.get(timeout=...) then waited for ever: the service had
    logged service_stopped and never exited. Here the handler takes 0.6 s (more than the 0.5 s poll
    the loop had) and closes the work from a thread, as ServiceRuntime's SIGTERM handler stops it."""
    script = textwrap.dedent(
        """
        import os, signal, threading, time
        from moe_lightning.service.main_thread import MainThreadWork

        work = MainThreadWork()

        def on_term(*_):
            time.sleep(0.6)
            threading.Thread(target=work.close, daemon=True).start()

        signal.signal(signal.SIGTERM, on_term)
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
        work.serve()
        print("served")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == "served", done.stderr
