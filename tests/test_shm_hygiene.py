"""Files in /dev/shm that merely match our naming pattern are not trusted: another local user's file,
one of another mode, a FIFO or a symlink is skipped (with a log line) by every sweep, never adopted
by the weight store, and never makes a start raise or hang."""

from __future__ import annotations

import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_weight_store import manifest, start

from moe_lightning.shm.segment import SHM_DIR, Segment, list_segments, segment_name, sweep_stale

DEAD = 2**22 - 1  # no such pid: what any leftover-looking name can claim
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting another uid's files needs root")


@pytest.fixture
def planted() -> Iterator[list[Path]]:
    """Paths a test plants in /dev/shm; removed afterwards whatever they are."""
    paths: list[Path] = []
    yield paths
    for p in paths:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def _plant(planted: list[Path], name: str, mode: int = 0o600, uid: int | None = None) -> Path:
    path = SHM_DIR / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
    os.ftruncate(fd, 4096)
    os.fchmod(fd, mode)  # whatever the umask
    os.close(fd)
    planted.append(path)
    if uid is not None:
        os.chown(path, uid, uid)
    return path


def _ours(run: str, what: str) -> str:
    name = segment_name(run, "weight_store", what, pid=DEAD)
    Segment.create(name, 4096).close()
    return name.lstrip("/")


def test_the_sweep_skips_fifos_symlinks_and_wrong_modes(planted: list[Path], tmp_path: Path) -> None:
    run = f"hyg{os.getpid()}"
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    link = SHM_DIR / f"mlt.{run}.weight_store.{DEAD}.link"
    link.symlink_to(victim)
    planted.append(link)
    fifo = SHM_DIR / f"mlt.{run}.weight_store.{DEAD}.fifo"
    os.mkfifo(fifo, 0o600)
    planted.append(fifo)
    loose = _plant(planted, f"mlt.{run}.weight_store.{DEAD}.loose", mode=0o644)
    genuine = _ours(run, "ok")
    assert sweep_stale(run, at_startup=True) == [genuine]
    assert link.is_symlink() and stat.S_ISFIFO(fifo.lstat().st_mode) and loose.exists()
    assert victim.read_bytes() == b"precious"


@as_root
def test_the_sweep_skips_another_users_files(planted: list[Path]) -> None:
    run = f"hygu{os.getpid()}"
    foreign = _plant(planted, f"mlt.{run}.weight_store.{DEAD}.arena", uid=NOBODY)
    sem = _plant(planted, f"sem.mlt.{run}.weight_store.{DEAD}.ch.items", uid=NOBODY)
    assert sweep_stale(run) == []
    assert foreign.exists() and sem.exists()


@as_root
def test_a_sweep_as_another_user_does_not_raise_on_files_it_cannot_remove(planted: list[Path]) -> None:
    """Not root: a leftover-looking file of someone else's, readable or not, is skipped rather than
    unlinked (which /dev/shm's sticky bit refuses with PermissionError, aborting every start)."""
    run = f"hygn{os.getpid()}"
    readable = _plant(planted, f"mlt.{run}.attn.{DEAD}.x", mode=0o644)
    private = _plant(planted, f"mlt.{run}.attn.{DEAD}.y", mode=0o600)
    pid = os.fork()
    if pid == 0:  # the child is the other user
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code = 0 if sweep_stale(run) == [] else 2
        except PermissionError:
            code = 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert readable.exists() and private.exists()


def _killed_store(model: Path, tmp_path: Path, run: str) -> tuple[Path, Path]:
    """A weight store killed after loading: its arena and ready marker are left, adoptable."""
    sock = tmp_path / "ws.sock"
    proc, seen = start(model, tmp_path / "cache", run, sock, tmp_path / "ws.log", "--no-cache")
    assert seen[-1] == 1
    region = manifest(sock).region.lstrip("/")
    proc.kill()
    proc.wait(30)
    return SHM_DIR / region, SHM_DIR / (region + "-ready")


def _successor(model: Path, tmp_path: Path, run: str) -> bool:
    """Starts a weight store (it must reach SERVING, not hang) and says whether it adopted; stops it."""
    sock = tmp_path / "ws.sock"
    proc, seen = start(model, tmp_path / "cache", run, sock, tmp_path / "ws.log", "--no-cache")
    try:
        assert seen and seen[-1] == 1, (tmp_path / "ws.log").read_text()[-3000:]
        return manifest(sock).adopted
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(30) == 0
        finally:
            proc.kill()


@as_root
@pytest.mark.parametrize("how", ["foreign_uid", "wrong_mode"])
def test_the_weight_store_does_not_adopt_an_arena_that_is_not_ours(
    tiny_model: Path, tmp_path: Path, planted: list[Path], how: str
) -> None:
    """The name and adoption key match and the size is right, but the file is another user's (who
    could rewrite the weights from then on) or not of our mode: not adopted, and left alone."""
    run = f"hyga{os.getpid()}{how[0]}"
    arena, ready = _killed_store(tiny_model, tmp_path, run)
    planted += [arena, ready]
    if how == "foreign_uid":
        os.chown(arena, NOBODY, NOBODY)
        os.chown(ready, NOBODY, NOBODY)
    else:
        os.chmod(arena, 0o644)
    assert not _successor(tiny_model, tmp_path, run)
    assert arena.exists()  # not ours: neither taken nor removed
    assert (arena.stat().st_uid == NOBODY) == (how == "foreign_uid")


def test_a_fifo_as_the_ready_marker_does_not_hang_the_weight_store(
    tiny_model: Path, tmp_path: Path, planted: list[Path]
) -> None:
    run = f"hygf{os.getpid()}"
    arena, ready = _killed_store(tiny_model, tmp_path, run)
    planted += [arena, ready]
    ready.unlink()
    os.mkfifo(ready, 0o600)  # opening it for reading would wait for a writer that never comes
    assert not _successor(tiny_model, tmp_path, run)
    assert stat.S_ISFIFO(ready.lstat().st_mode)  # skipped, not touched
    assert not arena.exists()  # our own leftover, with no valid marker: swept
    ready.unlink()
    assert list_segments(run) == []
