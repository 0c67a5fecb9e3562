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
another user's file, or our own file without `overwrite` (`run --overwrite`).

The directory is reached by descriptors, never by name: from "/" one component at a time, each
opened with O_DIRECTORY|O_NOFOLLOW relative to the one before (a missing one created there, mode
0755, and opened the same way), so a component swapped for a link between a check and a use is
refused instead of followed. A symbolic link on the way is followed only when it is ours or root's
(/var/run -> /run) and sits in a directory that passes the rule below (nobody else can replace it
with another link); it is read with readlink relative to the held directory and walked the same
way. The directory the file goes into must be owned by this user or by root, and if its group or
others may write to it, sticky (like /tmp: they may add names, which the checks of our own names
cover, but not rename or delete ours). Everything after that (the temporary file, the looks at the
target, the rename) is relative to the held descriptor. Directories above it are not held to that
rule: whoever may rename in one of them could only move directories that are ours or root's
(or make ours fail), never make us write through a link or into a directory of theirs.
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

_TRUSTED_OWNERS = {0}  # root's links and directories (/var/run -> /run, /tmp) are the system's
# O_PATH: a component we may search but not list (0711) can still be walked; elsewhere O_RDONLY
_WALK_FLAGS = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_PATH", os.O_RDONLY)
_MAX_LINKS = 40  # as the kernel's own path walk: a link loop is refused, not walked forever


class OutputFileError(UnsafePathError):
    """An output path the job refuses to write; the message names it, why, and what to do."""


class _Unsafe(Exception):
    """Why the walk to a directory stopped; the caller says which output it was for."""


def _refuse(path: Path, why: str) -> OutputFileError:
    return OutputFileError(f"refusing to write the output {path}: {why}")


def _trusted(uid: int) -> bool:
    return uid == os.geteuid() or uid in _TRUSTED_OWNERS


def _open_for_renames(st: os.stat_result) -> str | None:
    """Why a directory (`st`, from fstat of the held descriptor) is one where someone else can
    rename or delete our files, or None. Its owner can (chmod, rename, unlink), so it must be us or
    root; so can its group or anyone when they may write to it, unless it is sticky (/tmp: they may
    add names only, which the checks of our own names cover)."""
    if not _trusted(st.st_uid):
        return (
            f"its directory is owned by uid {st.st_uid}, not by this user or root: they may replace files "
            "in it (give a directory of yours)"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        who = "anyone" if st.st_mode & stat.S_IWOTH else f"its group (gid {st.st_gid})"
        return (
            f"its directory has mode {stat.S_IMODE(st.st_mode):04o}: {who} may replace files in it "
            "(give a directory of yours, or make this one sticky: chmod +t)"
        )
    return None


def _walk(directory: Path, create: bool) -> int | None:
    """A descriptor of the directory `directory` (absolute) names, reached from "/" one component at
    a time without following links another user could have put on the way (module docstring); with
    `create`, the missing components made (mode 0755 less the umask: even under umask 0 not one
    others may swap our files in). None: a component is missing and not `create`. Raises _Unsafe."""
    todo = list(reversed(directory.parts[1:]))  # the components still to walk, the next one last
    fd = os.open("/", _WALK_FLAGS)
    where = Path("/")
    links = 0
    try:
        while todo:
            name = todo.pop()
            if name in ("", "."):
                continue
            here = Path(os.path.normpath(where / name))  # for messages only: the walk goes by descriptors
            got = _step(fd, name, here, create)
            if got is None:
                os.close(fd)
                return None
            if isinstance(got, int):
                fd, old = got, fd
                os.close(old)
                where = here
                continue
            links += 1  # a trusted link: its target is walked in its place, from where it points
            if links > _MAX_LINKS:
                raise _Unsafe(f"{here}: too many levels of symbolic links")
            todo.extend(reversed(Path(got).parts))
            if os.path.isabs(got):
                fd, old = os.open("/", _WALK_FLAGS), fd
                os.close(old)
                where = Path("/")
                todo.pop()  # the "/" itself
        return fd
    except BaseException:
        os.close(fd)
        raise


def _step(fd: int, name: str, here: Path, create: bool) -> int | str | None:
    """One component `name` of the walk, relative to the held `fd`: its descriptor, or the target of
    a trusted symbolic link (str), or None (missing, not `create`). Raises _Unsafe."""
    for _ in range(8):  # made, then gone or replaced before we opened it: look again, a few times
        try:
            sub = os.open(name, _WALK_FLAGS, dir_fd=fd)
        except OSError as exc:
            error = exc.strerror
        else:
            if stat.S_ISDIR(os.fstat(sub).st_mode):
                return sub
            os.close(sub)  # never on Linux (O_DIRECTORY); a platform that opened a link itself: refuse it
            raise _Unsafe(f"{here} is not a directory")
        st = _lstat_at(name, fd)  # why it could not be opened
        if st is None:
            if not create:
                return None
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            except OSError as exc:
                raise _Unsafe(f"{here} could not be created ({exc.strerror})") from None
            continue
        if stat.S_ISLNK(st.st_mode):
            if not _trusted(st.st_uid):
                raise _Unsafe(f"{here} on its path is a symbolic link owned by uid {st.st_uid}, not by this user")
            # ours or root's, but in a directory others may rename in: by the time we read it, it may
            # be another link
            why = _open_for_renames(os.fstat(fd))
            if why is not None:
                raise _Unsafe(f"{here} on its path is a symbolic link others may replace: {why}")
            return os.readlink(name, dir_fd=fd)
        if not stat.S_ISDIR(st.st_mode):
            raise _Unsafe(f"{here} is not a directory")
        raise _Unsafe(f"{here} could not be opened ({error})")
    raise _Unsafe(f"{here} keeps changing while it is opened")


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


def _held_dir(path: Path, create: bool) -> int | None:
    """`_walk` to the directory of the output `path`, its refusals as OutputFileError; the directory
    held is then checked (`_open_for_renames`)."""
    try:
        fd = _walk(path.parent, create)
    except _Unsafe as exc:
        raise _refuse(path, str(exc)) from None
    if fd is not None:
        why = _open_for_renames(os.fstat(fd))
        if why is not None:
            os.close(fd)
            raise _refuse(path, why)
    return fd


def check_output_file(path: Path, overwrite: bool = False) -> None:
    """Raises OutputFileError if the job could not write `path` safely: call it before the job runs
    (a job that generates for an hour, then refuses its output, is a defect). A missing directory is
    fine (it is created at write time); `output_file` checks everything again when it writes."""
    path = Path(os.path.abspath(path))
    dir_fd = _held_dir(path, create=False)
    if dir_fd is None:
        return
    try:
        why = _target_problem(_lstat_at(path.name, dir_fd), overwrite)
    finally:
        os.close(dir_fd)
    if why is not None:
        raise _refuse(path, why)


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


def _readable(dir_fd: int) -> int:
    """The held directory opened for reading (fsync needs it; a walk's O_PATH descriptor cannot),
    through the descriptor, not its name; the O_PATH one where we may not read it (0733)."""
    try:
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    except PermissionError:
        return dir_fd
    os.close(dir_fd)
    return fd


@contextmanager
def output_file(path: Path, overwrite: bool = False) -> Iterator[IO[bytes]]:
    """A binary file to write the output `path` into; it appears at `path` (atomically, whole) when
    the block ends without an exception, and not at all otherwise (the temporary file is removed).
    Refuses (OutputFileError) what `check_output_file` refuses, looked at just before the rename, so
    a link planted while the job ran is refused too. The target is not looked at before the block:
    the caller holds finished results by then (`check_output_file` ran before the job), so a refusal,
    or a rename that fails (something put at the name after that last look), keeps the finished
    temporary file and names it: the results are not lost."""
    path = Path(os.path.abspath(path))
    held = _held_dir(path, create=True)
    if held is None:  # never: with create the walk makes what is missing
        raise _refuse(path, f"{path.parent} could not be created")
    dir_fd = _readable(held)
    try:
        fd, tmp = _create_temp(dir_fd, path)
        mine = os.fstat(fd)
        kept = f"the results are kept in {path.parent / tmp}"
        renamed = keep = False
        try:
            with os.fdopen(fd, "wb", closefd=False) as f:
                yield f
                f.flush()
            # its final mode now, before the fsync and the last look: a change of mode seen by someone
            # watching the directory (inotify) must not mark the moment between that look and the rename
            os.fchmod(fd, _file_mode(_lstat_at(path.name, dir_fd)))  # the descriptor, never the name
            os.fsync(fd)
            # the last look before the rename: a link (or another user's file) put there while the job ran
            why = _target_problem(_lstat_at(path.name, dir_fd), overwrite)
            now = _lstat_at(tmp, dir_fd)
            if now is None or (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
                why = why or f"its temporary file {path.parent / tmp} was replaced by someone else"
            elif why is not None:
                keep = True
                why += f"; {kept}"
            if why is not None:
                raise _refuse(path, why)
            try:
                os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except OSError as exc:
                # something put at the name after the last look (a directory, another user's file in a
                # sticky directory): the finished results stay where they are, and the message says where
                keep = True
                raise _refuse(
                    path, f"renaming the finished file to it failed ({exc.strerror}; was something put there?); {kept}"
                ) from exc
            renamed = True
            _sync_dir(dir_fd)
        finally:
            os.close(fd)
            if not renamed and not keep:
                _remove_if_ours(tmp, dir_fd, mine)
    finally:
        os.close(dir_fd)


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
        except OSError as exc:  # e.g. a directory we may not write to: the path and why, not a traceback
            raise _refuse(path, f"could not create a temporary file in {path.parent} ({exc.strerror})") from None
    raise _refuse(path, f"could not create a temporary file in {path.parent}")


def _sync_dir(dir_fd: int) -> None:
    """The rename itself survives a crash; some filesystems cannot sync a directory (and an O_PATH
    descriptor of one we may not read cannot be synced: EBADF)."""
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


def _output_dir_problem(path: Path, create: bool) -> str | None:
    """Why `path` cannot hold a job's output files (`check_output_dir`), or None; walked as
    `_walk` does, with `create` the missing directories made."""
    try:
        fd = _walk(path, create)
    except _Unsafe as exc:
        return str(exc)
    if fd is None:
        return None  # missing: we create it
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by this user (give a directory of yours)"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"its mode is {stat.S_IMODE(st.st_mode):04o}: others may add files to it (chmod go-w it)"
    return None


def check_output_dir(path: Path) -> None:
    """Raises OutputFileError unless `path` (missing: fine, we create it) can hold a job's output
    files (`run --ray` parts): reached as `_walk` reaches a directory (no link another user could
    have put on the way), a directory of ours, and one nobody else can add files to, neither its
    group nor others, sticky or not (a part planted under a part's name would be taken as done, a
    link under one would be refused only when that part is written)."""
    path = Path(os.path.abspath(path))
    why = _output_dir_problem(path, create=False)
    if why is not None:
        raise OutputFileError(f"refusing to write the output directory {path}: {why}")


def make_output_dir(path: Path) -> None:
    """`check_output_dir`, with the missing directories created on the way (mode 0755 less the
    umask, by the same walk): a directory the job made itself is never one it then refuses, whatever
    the umask (pyarrow's create_dir gives 0777 less it: 0777 under umask 0, 0775 under 0002)."""
    path = Path(os.path.abspath(path))
    why = _output_dir_problem(path, create=True)
    if why is not None:
        raise OutputFileError(f"refusing to write the output directory {path}: {why}")
