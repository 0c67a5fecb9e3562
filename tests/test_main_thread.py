"""MainThreadWork (moe_lightning/service/main_thread.py): work handed over from other threads runs on the
thread that serves, results and exceptions go back to the caller, and nothing waits for ever once the
loop ends."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from moe_lightning.service.main_thread import MainThreadWork, ServiceStoppingError


def serving(work: MainThreadWork) -> tuple[threading.Thread, threading.Event]:
    stopped = threading.Event()
    loop = threading.Thread(target=work.serve, args=(stopped, 0.05), name="serving-loop")
    loop.start()
    return loop, stopped


def test_work_from_many_threads_runs_on_the_serving_thread_and_returns_its_results() -> None:
    work = MainThreadWork()
    loop, stopped = serving(work)
    try:
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda i: work.run(lambda: (i * i, threading.current_thread().name)), range(200)))
    finally:
        stopped.set()
        loop.join(5)
    assert [v for v, _ in got] == [i * i for i in range(200)]
    assert {name for _, name in got} == {"serving-loop"}


def test_an_exception_reaches_the_caller_and_the_loop_goes_on() -> None:
    work = MainThreadWork()
    loop, stopped = serving(work)

    def fail() -> None:
        raise ValueError("bad step")

    try:
        with ThreadPoolExecutor(1) as pool:
            with pytest.raises(ValueError, match="bad step"):
                pool.submit(work.run, fail).result(5)
            assert pool.submit(work.run, lambda: 7).result(5) == 7
    finally:
        stopped.set()
        loop.join(5)


def test_before_the_loop_serves_work_runs_in_the_callers_thread() -> None:
    work = MainThreadWork()
    with ThreadPoolExecutor(1) as pool:
        name = pool.submit(work.run, lambda: threading.current_thread().name).result(5)
    assert name != threading.current_thread().name  # the pool's own thread: nothing serves yet


def test_once_the_loop_ends_work_fails_rather_than_waits() -> None:
    work = MainThreadWork()
    loop, stopped = serving(work)
    stopped.set()
    loop.join(5)
    assert not loop.is_alive()
    with ThreadPoolExecutor(1) as pool, pytest.raises(ServiceStoppingError):
        pool.submit(work.run, lambda: 1).result(5)
