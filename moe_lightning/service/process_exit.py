"""How a service process ends once its own shutdown has run (docs/reliability.md, "SIGTERM")."""

from __future__ import annotations

import atexit
import faulthandler
import os
import sys
import threading
from typing import NoReturn

# How long the end of a process may take once its shutdown hooks ran: joining the threads it left,
# the atexit hooks. A gRPC handler still blocked by then would keep a stopped service alive for ever
# (and `up`, or the kernel's parent-death signal, would have nothing left to stop it with).
EXIT_DEADLINE_SECONDS = 15.0


def exit_process(code: int | None, deadline: float = EXIT_DEADLINE_SECONDS) -> NoReturn:
    """Ends the process as interpreter shutdown would (non-daemon threads joined, thread-pool and
    atexit hooks run, output flushed), minus tearing down every module object by object: with torch
    loaded that took ~0.6 s per service after its clean-up had finished, and a stack stops four
    services. Nothing of ours relies on finalizers: segments and sockets are released by the
    service's shutdown hooks, the timeline is line-buffered, files on disk are renamed into place.

    If that takes more than `deadline` seconds, every thread's stack goes to stderr (the service's
    log) and the process ends anyway, with the same code."""
    status = 0 if code is None else code
    watchdog = threading.Thread(target=_stalled, args=(deadline, status), name="exit-watchdog", daemon=True)
    watchdog.start()
    join_threads = getattr(threading, "_shutdown", None)  # what Py_Finalize runs first
    if join_threads is None:  # another interpreter: the ordinary way
        sys.exit(code)
    join_threads()
    atexit._run_exitfuncs()
    _flush()
    os._exit(status)


def _stalled(deadline: float, status: int) -> None:
    threading.Event().wait(deadline)
    try:
        sys.stderr.write(f"exit_stalled: the process had not ended {deadline:.0f} s after its shutdown; its threads:\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (OSError, ValueError):  # stderr gone: end anyway
        pass
    _flush()
    os._exit(status)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to lose
            pass
