"""Named POSIX shared-memory segments, named after their owner and run, swept after a crash.

Name: `mlt.<run>.<owner>.<pid>.<what>`; the pid lets a later start tell a dead owner's leftovers
from a live peer's segments. Only the creator unlinks; attachers just map.

A name in /dev/shm proves nothing: any local user can create one that matches. A leftover is acted on
(swept, read, adopted) only when it is a regular file of our uid with the mode we create with (0600),
checked on a descriptor opened without following links and without blocking (a FIFO would hang a
reader); anything else is skipped with a log line.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

import posix_ipc
import structlog

from moe_lightning.shm.pages import FREE_SPACE, SHM_DIR, commit

if TYPE_CHECKING:
    import torch

PREFIX = "mlt"
_NAME_RE = re.compile(rf"^(?:sem\.)?{PREFIX}\.(?P<run>[\w-]+)\.(?P<owner>[\w-]+)\.(?P<pid>\d+)\.(?P<what>[\w.-]+)$")
_SAFE = re.compile(r"^[\w-]+$")
MODE = 0o600  # what posix_ipc creates our segments and semaphores with (its default)
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_log = structlog.get_logger()


def segment_name(run_id: str, owner: str, what: str, pid: int | None = None) -> str:
    for label, value in (("run_id", run_id), ("owner", owner)):
        if not _SAFE.match(value):
            raise ValueError(f"{label} may only hold letters, digits, '_' and '-', got {value!r}")
    return f"/{PREFIX}.{run_id}.{owner}.{os.getpid() if pid is None else pid}.{what}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _refusal(st: os.stat_result) -> str | None:
    """Why a leftover with this fstat is not ours to touch, or None."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not ours ({os.geteuid()})"
    if stat.S_IMODE(st.st_mode) != MODE:
        return f"mode {stat.S_IMODE(st.st_mode):o}, not {MODE:o}"
    return None


def open_leftover(path: Path) -> int | None:
    """A read-only descriptor on `path` if it is one of ours to act on, else None (logged).

    O_NOFOLLOW: a symlink is refused (ELOOP) rather than followed to someone's file; O_NONBLOCK: a
    FIFO opens at once instead of waiting for a writer, and fstat then rejects it. The check is on the
    descriptor, not the name, so a swap between check and use cannot pass another file off as ours.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None  # gone meanwhile (its owner cleaned up): nothing to do
    except OSError as exc:  # ELOOP (a symlink), EACCES (another user's 0600 file), ...
        _log.warning("shm_leftover_skipped", path=str(path), reason=exc.strerror or str(exc))
        return None
    try:
        reason = _refusal(os.fstat(fd))
    except OSError as exc:
        reason = exc.strerror or str(exc)
    if reason is not None:
        os.close(fd)
        _log.warning("shm_leftover_skipped", path=str(path), reason=reason)
        return None
    return fd


def leftover_stat(path: Path) -> os.stat_result | None:
    """fstat of `path` if it is one of ours to act on (see `open_leftover`), else None (logged)."""
    fd = open_leftover(path)
    if fd is None:
        return None
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def read_leftover(path: Path, limit: int) -> bytes | None:
    """Up to `limit` bytes of a leftover of ours (a ready marker), or None when it is not ours."""
    fd = open_leftover(path)
    if fd is None:
        return None
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


def stale_segments(
    run_id: str | None = None, owner: str | None = None, at_startup: bool = False
) -> list[tuple[Path, re.Match[str]]]:
    """Segments and semaphores of ours whose creating process is gone, with their parsed names.

    Scope it by `owner` when other owners may live in another pid namespace (containers), where
    their pids are not visible and would look dead. `at_startup`: called before this process made
    any segment, so one bearing our own pid is a previous incarnation's (a restarted container's
    service is pid 1 again). Only leftovers that are ours (`open_leftover`) are returned.
    """
    found = []
    if not SHM_DIR.is_dir():
        return found
    for path in SHM_DIR.iterdir():
        m = _NAME_RE.match(path.name)
        if m is None or (run_id and m["run"] != run_id) or (owner and m["owner"] != owner):
            continue
        pid = int(m["pid"])
        if not (at_startup and pid == os.getpid()) and pid_alive(pid):
            continue
        if leftover_stat(path) is None:
            continue
        found.append((path, m))
    return found


def sweep_stale(
    run_id: str | None = None, owner: str | None = None, at_startup: bool = False, keep: Collection[str] = ()
) -> list[str]:
    """Unlinks what `stale_segments` finds, except segments whose <what> is in `keep` (left for the
    caller to adopt); returns the names."""
    removed = []
    for path, m in stale_segments(run_id, owner, at_startup):
        if m["what"] in keep:
            continue
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            pass
        except OSError as exc:  # a sweep never aborts a start: what cannot go is left, and said
            _log.warning("shm_leftover_not_removed", path=str(path), reason=exc.strerror or str(exc))
    return removed


def adopt(path: Path, name: str, expect: os.stat_result | None = None) -> None:
    """Takes over a dead owner's segment under our own name. On Linux a segment is a tmpfs file:
    renaming it leaves every process that maps it (and the pages) untouched.

    Only a leftover of ours (`open_leftover`) is taken, and only the very file that was checked
    (`expect`, the caller's `leftover_stat`): another user's file would stay theirs to rewrite.
    Raises PermissionError otherwise (the file is left where it was).
    """
    st = leftover_stat(path)
    if st is None or (expect is not None and (st.st_dev, st.st_ino) != (expect.st_dev, expect.st_ino)):
        raise PermissionError(f"{path} is not a segment of ours (uid {os.geteuid()}, mode {MODE:o}); not adopted")
    target = SHM_DIR / name.lstrip("/")
    if path != target:
        os.rename(path, target)
    # the name we map from now on must be that file (a symlink or swap at the target would not be)
    after = os.stat(target, follow_symlinks=False)
    if (after.st_dev, after.st_ino) != (st.st_dev, st.st_ino):
        raise PermissionError(f"{target} changed while it was adopted; not adopted")


def list_segments(run_id: str | None = None) -> list[str]:
    """Our segments and semaphores currently in /dev/shm (for tests and `up`'s leak check)."""
    if not SHM_DIR.is_dir():
        return []
    out = []
    for path in SHM_DIR.iterdir():
        m = _NAME_RE.match(path.name)
        if m is not None and (run_id is None or m["run"] == run_id):
            out.append(path.name)
    return sorted(out)


class Segment:
    """A mapped shared-memory segment with zero-copy tensor views. The creator commits its pages
    (shm/pages.py): a full /dev/shm fails `create`, never a later touch with SIGBUS."""

    def __init__(self, name: str, size: int, created: bool, what: str = "", hint: str = FREE_SPACE) -> None:
        self.name = name
        self.size = size
        self.created = created
        flags = posix_ipc.O_CREX if created else 0
        shm = posix_ipc.SharedMemory(name, flags, size=size if created else 0)
        try:
            if created:
                commit(shm.fd, size, what or f"segment {name}", hint)
            self.size = shm.size
            self._mm = mmap.mmap(shm.fd, shm.size)
        except BaseException:
            if created:  # a segment we could not commit (or map) must not stay behind in /dev/shm
                shm.unlink()
            raise
        finally:
            shm.close_fd()
        # the tensor over the bytes is made at first use: the launcher lists and sweeps segments, and the
        # weight store fills its arena from its copy, through the mapping alone, without torch
        self._bytes: torch.Tensor | None = None
        self._open = self.size > 0
        self._views: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}

    @classmethod
    def create(cls, name: str, size: int, what: str = "", hint: str = FREE_SPACE) -> Segment:
        """A new segment of `size` committed bytes; `what` and `hint` word the error when /dev/shm cannot
        hold it (SharedMemoryFullError: "/dev/shm has N free, <what> needs M: <hint>")."""
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        return cls(name, size, created=True, what=what, hint=hint)

    @classmethod
    def attach(cls, name: str) -> Segment:
        try:
            return cls(name, 0, created=False)
        except posix_ipc.ExistentialError:
            raise FileNotFoundError(f"shared-memory segment {name} does not exist") from None

    @property
    def buf(self) -> mmap.mmap:
        return self._mm

    def bytes(self) -> torch.Tensor:
        """(size,) uint8 tensor over the whole segment."""
        if not self._open:
            raise ValueError(f"segment {self.name} is closed")
        if self._bytes is None:
            import torch

            self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        return self._bytes

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
        """A zero-copy view; offset must be aligned to the dtype's size.

        Views are cached by (offset, dtype, shape): building one costs ~10 us, and the hand-offs of a
        decode step reuse the same few shapes every layer.
        """
        shape = tuple(shape)
        key = (offset, dtype, shape)
        cached = self._views.get(key)
        if cached is not None:
            return cached
        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * dtype.itemsize
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"range [{offset}, {offset + nbytes}) is outside segment {self.name} ({self.size} bytes)")
        t = self.bytes()[offset : offset + nbytes].view(dtype).view(shape)
        if len(self._views) >= 4096:
            self._views.clear()
        self._views[key] = t
        return t

    def close(self) -> None:
        self._open = False
        self._bytes = None
        self._views.clear()
        try:
            self._mm.close()
        except BufferError:
            pass  # a tensor view is still alive; the mapping goes when it does
        except ValueError:
            pass

    def unlink(self) -> None:
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.created:
            self.unlink()
