"""What every part of the wake-up benchmark shares: object names, time budgets, liveness, sweeping.

Names carry the creating process's pid (``mlt-bench-<pid>-...``) so that a later run can tell the
objects of a run that was itself killed from those of a run still going, and remove only the former.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import tempfile

PREFIX = "mlt-bench-"
ALL_MECHS = ("sem", "zmq", "fifo", "spin", "iox2")
SLICE_S = 0.1  # wait slice; liveness is checked after every slice that times out
READY_BUDGET_S = 15.0  # peer start-up (interpreter + imports)
RT_BUDGET_S = 2.0  # a single round trip may not take longer than this
DEAD_BUDGET_S = 5.0  # hard upper bound for the dead-peer wait (the "never hangs" guarantee)
KILL_AFTER_S = 0.35  # the dead-peer check kills the peer this long after the waiter started waiting
TMPDIR = tempfile.gettempdir()


class PeerDiedError(RuntimeError):
    """The peer process is gone; ``via`` says how we found out."""

    def __init__(self, via: str) -> None:
        super().__init__(f"peer died (detected via {via})")
        self.via = via


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie.

    ``os.kill(pid, 0)`` alone succeeds on a zombie; that matters here because the benchmark's peer
    is our child and stays a zombie until reaped. Between truly unrelated processes the zombie is
    reaped by its own parent, but checking the /proc state is cheap and makes the check exact.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def our_paths(pid: int | None = None) -> list[str]:
    """Files of our named objects (semaphores, shared memory, sockets, FIFOs), of one run or all."""
    stem = f"{PREFIX}{pid}-" if pid is not None else PREFIX
    pats = [f"/dev/shm/sem.{stem}*", f"/dev/shm/{stem}*", os.path.join(TMPDIR, f"{stem}*")]
    return sorted({p for pat in pats for p in glob.glob(pat)})


def sweep_stale() -> list[str]:
    """Remove mlt-bench-<pid>-* objects whose creating process no longer exists (e.g. SIGKILLed run)."""
    removed = []
    for path in our_paths():
        m = re.search(rf"{PREFIX}(\d+)-", os.path.basename(path))
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
    return removed
