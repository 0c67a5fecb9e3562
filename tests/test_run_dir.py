"""The run directory and log files are private (nobody else can plant a socket, a log or a symbolic
link in them), and a port in use is an error instead of a port shared with whatever holds it."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from moe_lightning.config.stack import StackConfig
from moe_lightning.launcher import Stack, StackError
from moe_lightning.private_paths import UnsafePathError, checked_log_dir, open_log, private_dir, runtime_root

ROOT = os.geteuid() == 0
LINUX = sys.platform.startswith("linux")


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _prepared(tmp_path: Path, **config: object) -> Iterator[Stack]:
    stack = Stack(StackConfig(model=tmp_path / "no-model", port=0, **config))  # type: ignore[arg-type]
    try:
        stack.prepare()
        yield stack
    finally:
        stack.stop()


# --- the run directory ------------------------------------------------------------------------------


def test_default_run_dir_is_private_unique_and_removed(tmp_path: Path) -> None:
    a = Stack(StackConfig(model=tmp_path, run_id="same", port=0))
    b = Stack(StackConfig(model=tmp_path, run_id="same", port=0))
    a.prepare()
    b.prepare()
    try:
        assert a.run_dir is not None and b.run_dir is not None
        assert a.run_dir != b.run_dir  # mkdtemp: not /tmp/moe-lightning-<run id>, which anyone may pre-create
        for d in (a.run_dir, b.run_dir):
            assert d.parent == runtime_root() and d.name.startswith("moe-lightning-same-")
            assert not d.is_symlink() and d.is_dir()
            assert _mode(d) == 0o700 and d.stat().st_uid == os.getuid()
        assert a.addresses["weight_store"] == f"unix://{a.run_dir / 'weight_store.sock'}"
        made = a.run_dir
    finally:
        a.stop()
        b.stop()
    assert not made.exists()  # an empty directory of our own making is not left behind


def test_run_dir_under_xdg_runtime_dir_only_when_it_is_ours(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert runtime_root() == xdg
    d = private_dir(prefix="moe-lightning-x-")
    assert d.parent == xdg and _mode(d) == 0o700
    xdg.chmod(0o755)  # not a runtime dir of ours any more: the temp dir then
    assert runtime_root() != xdg


def test_configured_run_dir_is_created_private(tmp_path: Path) -> None:
    wanted = tmp_path / "a" / "run"
    for stack in _prepared(tmp_path, run_dir=wanted):
        assert stack.run_dir == wanted and _mode(wanted) == 0o700
    assert wanted.is_dir()  # the user's directory stays; only the sockets go


def test_world_writable_run_dir_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(StackError, match=rf"{d}.*mode is 0777: group or others have access"):
        next(_prepared(tmp_path, run_dir=d))
    assert not (d / "weight_store.sock").exists()


def test_group_readable_run_dir_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    d.chmod(0o750)
    with pytest.raises(UnsafePathError, match="0750"):
        private_dir(d)


@pytest.mark.skipif(not ROOT, reason="chown to another uid needs root")
def test_run_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(StackError, match=rf"{d}.*owned by uid 65534"):
        next(_prepared(tmp_path, run_dir=d))


def test_symlink_at_the_run_dir_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "run"
    link.symlink_to(target)
    with pytest.raises(StackError, match=rf"{link}.*symbolic link"):
        next(_prepared(tmp_path, run_dir=link))
    assert list(target.iterdir()) == []


def test_a_file_at_the_run_dir_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "run"
    f.write_text("")
    with pytest.raises(UnsafePathError, match="not a directory"):
        private_dir(f)


# --- log files ---------------------------------------------------------------------------------------


def test_log_files_are_0600_and_appended(tmp_path: Path) -> None:
    old = os.umask(0)  # the mode is ours to set, whatever the umask lets through
    try:
        with open_log(tmp_path / "x.log") as f:
            f.write(b"one\n")
        with open_log(tmp_path / "x.log") as f:
            f.write(b"two\n")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "x.log") == 0o600
    assert (tmp_path / "x.log").read_bytes() == b"one\ntwo\n"


def test_symlink_at_a_log_path_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    logs = checked_log_dir(tmp_path / "logs")
    (logs / "weight_store.log").symlink_to(victim)
    with pytest.raises(UnsafePathError, match="weight_store.log.*symbolic link"):
        open_log(logs / "weight_store.log")
    # and through the launcher: the service is not started, the link's target untouched
    stack = Stack(StackConfig(model=tmp_path / "no-model", port=0, log_dir=logs))
    try:
        stack.prepare()
        with pytest.raises(StackError, match="symbolic link"):
            stack.spawn(["weight_store"])
        assert stack.procs == {}
    finally:
        stack.stop()
    assert victim.read_text() == "precious\n"


def test_fifo_at_a_log_path_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "x.log"
    os.mkfifo(fifo)
    with pytest.raises(UnsafePathError, match="not a regular file"):
        open_log(fifo)


def test_log_dir_created_private_and_unsafe_ones_refused(tmp_path: Path) -> None:
    assert _mode(checked_log_dir(tmp_path / "new" / "logs")) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafePathError, match=rf"{shared}.*0777: group or others may write"):
        checked_log_dir(shared)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "new")
    with pytest.raises(UnsafePathError, match=rf"{link}.*symbolic link"):
        checked_log_dir(link)
    readable = tmp_path / "readable"
    readable.mkdir()
    readable.chmod(0o755)  # the user's own log directory, readable by others: theirs to allow
    assert checked_log_dir(readable) == readable


def test_bench_log_dir_is_private_and_found_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from bench.gpucheck.processes import _log_dir
    from moe_lightning.benchmark import bench_log_prefix

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    tmp_path.chmod(0o700)
    planted = tmp_path / f"{bench_log_prefix('bench42')}zzzzzzzz"  # someone else's guess: not ours to read
    planted.mkdir()
    planted.chmod(0o777)
    assert _log_dir("bench42") is None
    mine = private_dir(prefix=bench_log_prefix("bench42"))
    assert _mode(mine) == 0o700
    assert _log_dir("bench42") == mine
    assert _log_dir("bench4") is None  # another run's prefix does not match


# --- a port in use -----------------------------------------------------------------------------------


def test_grpc_server_will_not_share_a_port() -> None:
    """SO_REUSEPORT off: a second server (say, a second stack's orchestrator while an orphan of the
    first still holds the port) fails to bind instead of sharing the port with it."""
    from moe_lightning.service.runtime import ServiceRuntime

    first = ServiceRuntime("first", "127.0.0.1:0", None)
    try:
        with pytest.raises(RuntimeError, match=rf"Failed to bind to address 127\.0\.0\.1:{first.port}"):
            ServiceRuntime("second", f"127.0.0.1:{first.port}", None)
    finally:
        first.server.stop(0)


def test_launcher_names_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        stack = Stack(StackConfig(model=tmp_path, port=port))
        with pytest.raises(StackError, match=rf"127\.0\.0\.1:{port} is already in use"):
            stack.start(timeout=5)
        assert stack.procs == {}


def test_the_asyncio_server_will_not_share_a_port_either() -> None:
    """The public API runs on grpc.aio: the same server options, so the same refusal."""
    from moe_lightning.service.aio_runtime import AioServiceRuntime
    from moe_lightning.service.runtime import ServiceRuntime

    first = ServiceRuntime("first", "127.0.0.1:0", None)

    async def second() -> None:
        AioServiceRuntime("second", f"127.0.0.1:{first.port}", None, "127.0.0.1", 1.0, None, (), 4 << 20)

    try:
        with pytest.raises(RuntimeError, match=rf"Failed to bind to address 127\.0\.0\.1:{first.port}"):
            asyncio.run(second())
    finally:
        first.server.stop(0)
