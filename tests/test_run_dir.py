"""The run directory and log files are private (nobody else can plant a socket, a log or a symbolic
link in them), services never outlive the process that launched them, and a port in use is an
error instead of a port shared with whatever holds it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from moe_lightning.launcher import (
    Stack,
    StackConfig,
    StackError,
    _spawner,
    checked_log_dir,
    open_log,
    parent_death_hook,
    private_dir,
    runtime_root,
)
from moe_lightning.shm.segment import list_segments

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
    with pytest.raises(StackError, match="0750"):
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
    with pytest.raises(StackError, match="not a directory"):
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
    with pytest.raises(StackError, match="weight_store.log.*symbolic link"):
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
    with pytest.raises(StackError, match="not a regular file"):
        open_log(fifo)


def test_log_dir_created_private_and_unsafe_ones_refused(tmp_path: Path) -> None:
    assert _mode(checked_log_dir(tmp_path / "new" / "logs")) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(StackError, match=rf"{shared}.*0777: group or others may write"):
        checked_log_dir(shared)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "new")
    with pytest.raises(StackError, match=rf"{link}.*symbolic link"):
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


# --- no service outlives its launcher ---------------------------------------------------------------


def _gone(pid: int) -> bool:
    """Exited (a zombie left for a pid 1 that may not reap it counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if not _gone(p)]


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


@pytest.mark.skipif(not LINUX, reason="PR_SET_PDEATHSIG is Linux's")
def test_child_whose_parent_already_died_exits_at_once() -> None:
    """The race: the parent died between fork and prctl, so the signal would never come."""
    hook = parent_death_hook(parent=1)  # "the parent" is some other process than the one that forks
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], preexec_fn=hook)
    assert child.wait(10) == 1


@pytest.mark.skipif(not LINUX, reason="PR_SET_PDEATHSIG is Linux's")
def test_children_outlive_the_thread_that_asked_for_them() -> None:
    """The kernel's parent-death signal follows the forking *thread*: the spawner thread forks them all,
    so a service restarted from the supervisor thread does not die when that thread ends."""
    procs: list[subprocess.Popen[bytes]] = []

    def spawn() -> None:
        argv = [sys.executable, "-c", "import time; time.sleep(30)"]
        _spawner.run(lambda: procs.append(subprocess.Popen(argv, preexec_fn=parent_death_hook())))

    t = threading.Thread(target=spawn)
    t.start()
    t.join()
    time.sleep(1.0)
    try:
        assert procs[0].poll() is None
    finally:
        procs[0].kill()
        procs[0].wait()


@pytest.mark.skipif(not LINUX, reason="PR_SET_PDEATHSIG is Linux's")
def test_kill_9_of_a_launcher_process_kills_its_children(tmp_path: Path) -> None:
    """A launcher process (the spawner and hook as Stack uses them, in a subprocess) killed with -9:
    its children, in sessions of their own, get SIGTERM from the kernel."""
    script = textwrap.dedent(
        """
        import subprocess, sys, time
        from moe_lightning.launcher import _spawner, parent_death_hook
        argv = [sys.executable, "-c", "import time; time.sleep(60)"]
        kids = [_spawner.run(lambda: subprocess.Popen(argv, start_new_session=True, preexec_fn=parent_death_hook()))
                for _ in range(3)]
        print(" ".join(str(k.pid) for k in kids), flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 3 and not any(_gone(p) for p in pids)  # alive while the launcher is
    parent.kill()
    parent.wait()
    assert _wait_gone(pids, 5) == []


class Up:
    """`moe-lightning up` as a user runs it, on the tiny model."""

    def __init__(self, model: Path, run_id: str, log_dir: Path) -> None:
        self.run_id = run_id
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "moe_lightning.cli",
                "up",
                "--model",
                str(model),
                "--port",
                "0",
                "--json",
                "--no-restart",
                "--run-id",
                run_id,
                "--kv-cache-memory",
                "32MiB",
                "--log-dir",
                str(log_dir),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def services(self) -> dict[str, int]:
        """Service name -> pid of the up process's children (from their `python -m <module>`)."""
        from moe_lightning.launcher import SERVICES

        modules = {module: name for name, (module, _) in SERVICES.items()}
        out = {}
        for child in _children(self.proc.pid):
            argv = _cmdline(child)
            if "-m" in argv and argv[argv.index("-m") + 1] in modules:
                out[modules[argv[argv.index("-m") + 1]]] = child
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.skipif(not LINUX, reason="PR_SET_PDEATHSIG is Linux's")
def test_kill_9_of_up_leaves_no_service_running(tiny_model: Path, tmp_path: Path) -> None:
    up = Up(tiny_model, f"k9{os.getpid()}", tmp_path / "logs")
    try:
        assert up.proc.stdout is not None
        line = up.proc.stdout.readline()
        assert line, up.proc.stderr.read() if up.proc.stderr else ""
        pids = [int(e["pid"]) for e in json.loads(line).values()]
        assert len(pids) == 4 and all(not _gone(p) for p in pids)
        t0 = time.monotonic()
        up.proc.kill()  # nothing of `up` runs now: no stop(), no finally
        up.proc.wait()
        left = _wait_gone(pids, 20)
        assert left == [], f"still running after up was killed: {left}"
        print(f"all four services gone {time.monotonic() - t0:.1f} s after kill -9 of up")
        # they got SIGTERM, so they cleaned up as at any stop: no segment of theirs is left
        deadline = time.monotonic() + 5
        while list_segments(up.run_id) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list_segments(up.run_id) == []
    finally:
        up.close()
        for d in runtime_root().glob(f"moe-lightning-{up.run_id}-*"):  # the run dir: up had no chance to
            shutil.rmtree(d, ignore_errors=True)
        for p in pids if "pids" in locals() else []:
            if not _gone(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.skipif(not LINUX, reason="/proc is read to find the services")
def test_sigterm_during_start_up_stops_up_promptly(tiny_model: Path, tmp_path: Path) -> None:
    """The weight store is held (SIGSTOP) so the stack cannot become SERVING: `up` must still stop
    at SIGTERM, not once every service is ready (nor at its 600 s start-up timeout)."""
    up = Up(tiny_model, f"st{os.getpid()}", tmp_path / "logs")
    held = None
    try:
        deadline = time.monotonic() + 60
        while len(services := up.services()) < 4 and up.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(services) == 4, f"services seen: {services}"
        held = services["weight_store"]
        os.kill(held, signal.SIGSTOP)
        time.sleep(1.0)
        t0 = time.monotonic()
        up.proc.send_signal(signal.SIGTERM)
        time.sleep(2.0)
        os.kill(held, signal.SIGCONT)  # now it sees the SIGTERM that up's stop() sent it
        out, err = up.proc.communicate(timeout=30)
        took = time.monotonic() - t0
        assert up.proc.returncode == 0, err
        assert out == "", f"up claimed it was serving: {out!r}"
        assert "stopped during start-up" in err
        assert _wait_gone(list(services.values()), 5) == []
        assert list_segments(up.run_id) == []
        assert took < 30
        print(f"up stopped {took:.1f} s after SIGTERM during start-up")
    finally:
        if held is not None and not _gone(held):
            os.kill(held, signal.SIGCONT)
        up.close()
