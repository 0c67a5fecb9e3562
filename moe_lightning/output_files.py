"""The one way a job writes an output file (`run --output`, the OpenAI Batch results, a `run --ray`
part): never through a name someone else controls.

On a shared machine the output path may sit in a directory others can write to (/tmp, a 0777
scratch directory). Opening the path itself would follow a symbolic link another user planted there
(overwriting whatever file it points to, or creating a file where they choose) or truncate a file
of theirs they then read. So the data goes into a temporary file that only we can have created
(O_CREAT|O_EXCL|O_NOFOLLOW, an unguessable name, mode 0600 while it is written) in the target's
directory, and is renamed into place: a rename replaces the directory entry and never writes
through a link. Before the job starts and again just before the rename, the target is refused
(`OutputFileError`, naming the path and what to do) when it is a symbolic link, not a regular file,
another user's file, or our own file without `overwrite` (`run --overwrite`); and so is a directory
anyone may rename files in (world-writable, not sticky), or a symbolic link on the way there owned by
another user. Every step after the checks works relative to one open descriptor of the directory,
so swapping a directory on the path mid-job changes nothing.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from moe_lightning.private_paths import UnsafePathError

_TRUSTED_LINK_OWNERS = {0}  # root's links (/var/run -> /run) are the system's, not another user's


class OutputFileError(UnsafePathError):
    """An output path the job refuses to write; the message names it, why, and what to do."""


def _refuse(path: Path, why: str) -> OutputFileError:
    return OutputFileError(f"refusing to write the output {path}: {why}")


def _links_on_the_way(directory: Path) -> str | None:
    """Why `directory` (absolute) is reached through a symbolic link another user owns, or None:
    such a link decides where our file goes (e.g. /tmp/shared/results -> /root/.ssh)."""
    me = os.geteuid()
    current = Path(directory.anchor)
    for part in directory.parts[1:]:
        current = current / part
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return None  # the rest is created by us
        if stat.S_ISLNK(st.st_mode) and st.st_uid != me and st.st_uid not in _TRUSTED_LINK_OWNERS:
            return f"{current} on its path is a symbolic link owned by uid {st.st_uid}, not by this user"
    return None


def _open_for_renames(st: os.stat_result) -> str | None:
    """Why a directory is one where anyone can rename or delete our files, or None. A sticky one
    (/tmp) lets others add names only, which the checks of our own names cover."""
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return (
            f"its directory has mode {stat.S_IMODE(st.st_mode):04o}: anyone may replace files in it "
            "(give a directory of yours, or make this one sticky: chmod +t)"
        )
    return None


def _target_problem(st: os.stat_result | None, overwrite: bool) -> str | None:
    """Why the existing entry at the output name (`st`, from lstat; None: there is none) must not
    be replaced, or None."""
    if st is None:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link (give the path of the file itself, or another --output)"
    if not stat.S_ISREG(st.st_mode):
        return "it exists and is not a regular file"
    if st.st_uid != os.geteuid():
        return f"it exists and is owned by uid {st.st_uid}, not by this user (give another --output)"
    if not overwrite:
        return "it exists (pass --overwrite to replace it, or give another --output)"
    return None


def _lstat_at(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def check_output_file(path: Path, overwrite: bool = False) -> None:
    """Raises OutputFileError if the job could not write `path` safely: call it before the job runs
    (a job that generates for an hour, then refuses its output, is a defect). A missing directory is
    fine (it is created at write time); `output_file` checks everything again when it writes."""
    path = Path(os.path.abspath(path))
    why = _links_on_the_way(path.parent)
    if why is None and path.parent.exists():  # our own links on the way are followed
        if not path.parent.is_dir():
            why = f"{path.parent} is not a directory"
        else:
            why = _open_for_renames(os.stat(path.parent)) or _target_problem(_lstat(path), overwrite)
    if why is not None:
        raise _refuse(path, why)


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _file_mode(existing: os.stat_result | None) -> int:
    """What the finished output gets: a replaced file of ours keeps its permissions (as writing it
    in place would have), a new one those of a file we create under our umask; never world-writable,
    and a new one not group-writable either (the output is the user's own result)."""
    if existing is not None and stat.S_ISREG(existing.st_mode) and existing.st_uid == os.geteuid():
        return stat.S_IMODE(existing.st_mode) & 0o775
    return 0o644 & ~_umask()


def _umask() -> int:
    """The process's umask without changing it: os.umask() sets it, which is a race with the other
    threads of a process (a Ray actor's) that create files meanwhile."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def output_file(path: Path, overwrite: bool = False) -> Iterator[IO[bytes]]:
    """A binary file to write the output `path` into; it appears at `path` (atomically, whole) when
    the block ends without an exception, and not at all otherwise (the temporary file is removed).
    Refuses (OutputFileError) what `check_output_file` refuses, checked again now and once more
    just before the rename, so a link planted while the job ran is refused too. A refusal at that
    last moment keeps the finished temporary file and names it: the results are not lost."""
    path = Path(os.path.abspath(path))
    why = _links_on_the_way(path.parent)
    if why is not None:
        raise _refuse(path, why)
    _make_dirs(path.parent)
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except NotADirectoryError:
        raise _refuse(path, f"{path.parent} is not a directory") from None
    try:
        # the directory we hold must be the one the checked path names (not one swapped in meanwhile)
        held, named = os.fstat(dir_fd), os.stat(path.parent)
        why = _links_on_the_way(path.parent)
        if why is None and (held.st_dev, held.st_ino) != (named.st_dev, named.st_ino):
            why = f"{path.parent} was replaced while it was opened"
        why = why or _open_for_renames(held) or _target_problem(_lstat_at(path.name, dir_fd), overwrite)
        if why is not None:
            raise _refuse(path, why)
        fd, tmp = _create_temp(dir_fd, path)
        mine = os.fstat(fd)
        renamed = keep = False
        try:
            with os.fdopen(fd, "wb", closefd=False) as f:
                yield f
                f.flush()
            os.fsync(fd)
            existing = _lstat_at(path.name, dir_fd)
            os.fchmod(fd, _file_mode(existing))  # the descriptor, never the name: a name may be swapped
            # the last look before the rename: a link (or another user's file) put there while the job ran
            why = _target_problem(existing, overwrite)
            now = _lstat_at(tmp, dir_fd)
            if now is None or (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
                why = why or f"its temporary file {path.parent / tmp} was replaced by someone else"
            elif why is not None:
                keep = True
                why += f"; the results are kept in {path.parent / tmp}"
            if why is not None:
                raise _refuse(path, why)
            os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            renamed = True
            _sync_dir(dir_fd)
        finally:
            os.close(fd)
            if not renamed and not keep:
                _remove_if_ours(tmp, dir_fd, mine)
    finally:
        os.close(dir_fd)


def _make_dirs(directory: Path) -> None:
    """The missing directories up to `directory`, mode 0755 (less the umask): even under umask 0 one
    we create is not one others may swap our files in (Path.mkdir(parents=True) gives parents 0777
    less the umask)."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o755)
        except FileExistsError:
            pass


def _create_temp(dir_fd: int, path: Path) -> tuple[int, str]:
    """A new file only we can have created, in the held directory: O_EXCL (never an existing file)
    and O_NOFOLLOW (never through a link), mode 0600 while it is partial (nobody reads half a file)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(8):  # a name already there (planted, or a leftover): another unguessable one
        tmp = f".{path.name}.{secrets.token_hex(8)}.tmp"
        try:
            return os.open(tmp, flags, 0o600, dir_fd=dir_fd), tmp
        except FileExistsError:
            continue
    raise _refuse(path, f"could not create a temporary file in {path.parent}")


def _sync_dir(dir_fd: int) -> None:
    """The rename itself survives a crash; some filesystems cannot sync a directory."""
    try:
        os.fsync(dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise


def _remove_if_ours(name: str, dir_fd: int, mine: os.stat_result) -> None:
    st = _lstat_at(name, dir_fd)
    if st is not None and (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass


def check_output_dir(path: Path) -> None:
    """Raises OutputFileError unless `path` (missing: fine, we create it) can hold a job's output
    files (`run --ray` parts): reached through no link of another user's, a directory of ours, and
    one others cannot add files to (a part planted under a part's name would be taken as done, a
    link under one would be refused only when that part is written)."""
    path = Path(os.path.abspath(path))
    why = _links_on_the_way(path)
    if why is None and path.exists():
        st = os.stat(path)
        if not stat.S_ISDIR(st.st_mode):
            why = "it is not a directory"
        elif st.st_uid != os.geteuid():
            why = f"it is owned by uid {st.st_uid}, not by this user (give a directory of yours)"
        elif st.st_mode & stat.S_IWOTH:
            why = f"its mode is {stat.S_IMODE(st.st_mode):04o}: others may add files to it (chmod o-w it)"
    if why is not None:
        raise OutputFileError(f"refusing to write the output directory {path}: {why}")
