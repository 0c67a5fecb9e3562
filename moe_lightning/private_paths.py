"""Paths only this user may use: private directories, log files opened without following links.

On a shared machine anything predictable under /tmp may have been created first by someone else:
a directory they own could get our sockets replaced by their listeners, a symbolic link at a log
path could make us append to any file we can write (docs/reliability.md, "Shared machines and
public endpoints"). Everything here refuses what is not ours instead of trusting it.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import IO


class UnsafePathError(PermissionError):
    """A path that another user could control; the message names it and why."""


def not_private(path: Path) -> str | None:
    """Why `path` is not a directory that only this user can use, or None if it is: a real directory
    (not a symbolic link), owned by our uid, no access for group or others."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "it does not exist"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & 0o077:
        return f"its mode is {stat.S_IMODE(st.st_mode):04o}: group or others have access (chmod 700 it)"
    return None


def runtime_root() -> Path:
    """Where private per-run directories go: $XDG_RUNTIME_DIR when it is set and ours, else the temp dir."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_absolute() and not_private(Path(xdg)) is None:
        return Path(xdg)
    return Path(tempfile.gettempdir())


def private_dir(path: Path | None = None, prefix: str = "moe-lightning-") -> Path:
    """A directory only this user can use. None: a new one (mkdtemp: an unpredictable name, mode 0700)
    under `runtime_root()`. A path: created with mode 0700 if missing; one that already exists is
    refused (StackError naming it and why) unless it is a real directory of ours with no group or
    other access, so that nobody else can plant a socket, a log file or a symbolic link in it."""
    if path is None:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=runtime_root()))
    path = Path(path)
    if not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    why = not_private(path)
    if why is not None:
        raise UnsafePathError(f"refusing to use {path} as a private directory: {why}")
    return path


def checked_log_dir(path: Path) -> Path:
    """A log directory given by the user: created 0700 if missing; an existing one must be a real
    directory (not a symbolic link) of ours that group and others cannot write to (reading is theirs
    to allow: it is the user's own directory)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    why = None
    if stat.S_ISLNK(st.st_mode):
        why = "it is a symbolic link (give the directory it points to)"
    elif not stat.S_ISDIR(st.st_mode):
        why = "it is not a directory"
    elif st.st_uid != os.getuid():
        why = f"it is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    elif st.st_mode & 0o022:
        why = f"its mode is {stat.S_IMODE(st.st_mode):04o}: group or others may write to it"
    if why is not None:
        raise UnsafePathError(f"refusing to write logs in {path}: {why}")
    return path


def open_log(path: Path) -> IO[bytes]:
    """Opens (creating with mode 0600) a log file for appending, never through a symbolic link, and
    only if it is a regular file of ours (not a FIFO that would block, nor someone else's file)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(f"refusing to write the log {path}: it is a symbolic link") from None
        if exc.errno == errno.ENXIO:  # a FIFO with no reader
            raise UnsafePathError(f"refusing to write the log {path}: it is not a regular file") from None
        raise UnsafePathError(f"cannot open the log {path}: {exc.strerror}") from None
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = "it is not a regular file"
    elif st.st_uid != os.getuid():
        why = f"it is owned by uid {st.st_uid}, not by this user"
    if why is not None:
        os.close(fd)
        raise UnsafePathError(f"refusing to write the log {path}: {why}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "ab")


def read_tail(path: Path, lines: int) -> list[str]:
    """The last lines of a log, read without following a symbolic link; [] if there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return []
        return f.read().decode(errors="replace").strip().splitlines()[-lines:]
