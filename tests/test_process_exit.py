"""A service ends without Python's module teardown (moe_lightning/service/process_exit.py), but
with everything interpreter shutdown does that a service may rely on: its exit code, non-daemon
threads finished, thread pools drained, atexit hooks run, buffered output written."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_exit_process_keeps_what_interpreter_shutdown_does() -> None:
    script = textwrap.dedent(
        """
        import atexit, sys, threading, time
        from concurrent.futures import ThreadPoolExecutor
        from moe_lightning.service.process_exit import exit_process

        atexit.register(lambda: print("atexit hook ran"))
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
        pool = ThreadPoolExecutor(1)
        pool.submit(lambda: (time.sleep(0.3), print("pool job finished")))
        sys.stdout.write("buffered, no newline")
        exit_process(3)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr
    lines = out.stdout
    assert "thread finished" in lines and "pool job finished" in lines and "buffered, no newline" in lines
    assert lines.rstrip().endswith("atexit hook ran")  # after the threads, as at interpreter exit


def test_a_thread_that_never_ends_does_not_keep_a_stopped_service_alive() -> None:
    """A non-daemon thread still blocked at exit (a gRPC handler waiting for ever) would hold the
    process past its shutdown: after the deadline the threads' stacks go to stderr and it ends, with
    its code."""
    script = textwrap.dedent(
        """
        import threading
        from moe_lightning.service.process_exit import exit_process

        def stuck_handler():
            threading.Event().wait()

        threading.Thread(target=stuck_handler, name="stuck").start()
        print("stopping", flush=True)
        exit_process(0, deadline=1.0)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "stopping"
    assert "exit_stalled" in out.stderr and "stuck_handler" in out.stderr, out.stderr
