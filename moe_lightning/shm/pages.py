"""Committed pages: a segment's memory is reserved when the segment is made, never assumed.

On Linux a segment is a tmpfs file in /dev/shm, and ftruncate only sets its size: its pages come
from the file system's free space at their first touch. When another local user fills /dev/shm
in between (one `dd`), that touch is a SIGBUS, which no handler can turn into an error for one
request: the process dies. `commit` reserves every page at creation (posix_fallocate on the
descriptor: tmpfs allocates them, counted against its size), so a full /dev/shm is an error of the
call that makes the segment, at start-up, naming what needed how much.

A service whose start fails for this exits with EXIT_NO_SHARED_MEMORY, which `up`'s supervisor
retries with back-off instead of counting it towards a crash loop: space may come back (the other
user's file removed), a bug does not.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

EXIT_NO_SHARED_MEMORY = 75  # EX_TEMPFAIL (sysexits.h): "try again later"
SHM_DIR = Path("/dev/shm")
_NO_SPACE = (errno.ENOSPC, errno.ENOMEM)  # tmpfs full; a memory cgroup or the host out of pages
_NO_FALLOCATE = (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)  # a file system without it (not tmpfs)
SEMAPHORE_BYTES = 4096  # a POSIX semaphore is a small file in /dev/shm: one page of it
FREE_SPACE = "free space in /dev/shm (remove what fills it, or mount it larger)"


class SharedMemoryFullError(OSError):
    """/dev/shm cannot hold a segment (or semaphore) that we need; the message says how much."""

    def __init__(self, what: str, needed: int, hint: str = FREE_SPACE, free: int | None = None) -> None:
        from moe_lightning.config.units import format_size

        self.needed = needed
        self.free = shm_free() if free is None else free
        super().__init__(
            errno.ENOSPC, f"/dev/shm has {format_size(self.free)} free, {what} needs {format_size(needed)}: {hint}"
        )

    def __str__(self) -> str:
        return str(self.strerror)  # the message alone, without OSError's "[Errno 28]" prefix


def shm_free(shm_dir: Path = SHM_DIR) -> int:
    """Bytes /dev/shm's file system may still hold (0 when it cannot be read)."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def is_no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _NO_SPACE


def no_space_as_full(exc: OSError, what: str, needed: int) -> OSError:
    """`exc` as a SharedMemoryFullError when it says that /dev/shm is out of space, else itself."""
    return SharedMemoryFullError(what, needed) if is_no_space(exc) else exc


def commit(fd: int, size: int, what: str, hint: str = FREE_SPACE) -> None:
    """Reserves the pages of bytes [0, size) of the file `fd`; SharedMemoryFullError when they are not
    there. A tmpfs that fails part-way gives back what it had reserved, so nothing is left half-held.
    Costs ~0.25 s a GiB (allocation; the pages are zeroed at their first touch, as without it)."""
    if size <= 0 or not hasattr(os, "posix_fallocate"):
        return  # macOS: no /dev/shm file system to run out of in this way
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in _NO_FALLOCATE:
            return  # not tmpfs: the file system gives pages as it does
        if exc.errno in _NO_SPACE:
            raise SharedMemoryFullError(what, size, hint) from None
        raise


def shortage(exc: BaseException | None) -> SharedMemoryFullError | None:
    """The SharedMemoryFullError `exc` is or was raised from (its cause or context), if any."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, SharedMemoryFullError):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None
