"""Services never outlive the process that launched them: the kernel's parent-death signal, armed
from one spawner thread, and `up` stopping promptly on SIGTERM while it waits for readiness."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from moe_lightning.children import spawner, with_parent_death
from moe_lightning.private_paths import runtime_root
from moe_lightning.shm.segment import list_segments

from processes import UpProcess

LINUX = sys.platform.startswith("linux")


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


def _left_behind(pids: list[int], logs: Path) -> str:
    """What a failure needs to name a process that outlived its launcher: each one's command line, state
    and kernel wait channel, and the end of every log of the run (its last words, if it logged any)."""
    lines = []
    for pid in pids:
        try:
            status = dict(
                line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
            )
            wchan = Path(f"/proc/{pid}/wchan").read_text()
        except OSError:
            status, wchan = {}, "?"
        state, threads = status.get("State", "?").strip(), status.get("Threads", "?").strip()
        lines.append(f"pid {pid}: {' '.join(_cmdline(pid))[-300:]} (state {state}, {threads} threads, in {wchan})")
    for log in sorted(logs.glob("**/*")) if logs.is_dir() else []:
        if log.is_file():
            tail = log.read_text(errors="replace").splitlines()[-8:]
            lines += [f"--- {log.name}", *tail]
    return "\n".join(lines)


@pytest.mark.skipif(not LINUX, reason="PR_SET_PDEATHSIG is Linux's")
def test_child_whose_parent_already_died_exits_at_once() -> None:
    """The race: the parent died between fork and prctl, so the signal would never come."""
    argv = with_parent_death([sys.executable, "-c", "import time; time.sleep(30)"], parent=1)  # not us
    child = subprocess.Popen(argv)
    assert child.wait(10) == 1


_BUSY_GRPC_PARENT = """
import subprocess, sys, threading
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from moe_lightning.children import spawner, with_parent_death
server = grpc.server(futures.ThreadPoolExecutor(8))
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
done = threading.Event()
def pound():
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    while not done.is_set():
        stub.Check(health_pb2.HealthCheckRequest())
pounders = [threading.Thread(target=pound, daemon=True) for _ in range(4)]
for t in pounders:
    t.start()
argv = with_parent_death([sys.executable, "-c", "pass"])
codes = [spawner.run(lambda: subprocess.Popen(argv)).wait() for _ in range(40)]
done.set()
# Exiting with calls in flight races gRPC's server thread against interpreter shutdown (its executor
# refuses work, the thread dies, a pending call never ends and exit hangs): end them before exiting.
for t in pounders:
    t.join(30)
server.stop(None).wait(30)
print("codes", sorted(set(codes)), flush=True)
"""


@pytest.mark.skipif(not LINUX, reason="PR_SET_PDEATHSIG is Linux's")
def test_children_start_cleanly_from_a_process_busy_in_grpc() -> None:
    """A TP leader and a launcher fork while their gRPC threads are busy. With the signal armed in a
    preexec_fn, gRPC's fork handlers ran in the forked child and broke the parent's poller ("epoll_wait
    error: Bad file descriptor") and aborted children (CI: a rank "exited with code -6"): 40 spawns under
    load must all exit 0 and leave gRPC silent."""
    out = subprocess.run([sys.executable, "-c", _BUSY_GRPC_PARENT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "codes [0]" in out.stdout
    assert "fork_posix" not in out.stderr and "Bad file descriptor" not in out.stderr, out.stderr[-2000:]


@pytest.mark.skipif(not LINUX, reason="PR_SET_PDEATHSIG is Linux's")
def test_children_outlive_the_thread_that_asked_for_them() -> None:
    """The kernel's parent-death signal follows the forking *thread*: the spawner thread forks them all,
    so a service restarted from the supervisor thread does not die when that thread ends."""
    procs: list[subprocess.Popen[bytes]] = []

    def spawn() -> None:
        argv = [sys.executable, "-c", "import time; time.sleep(30)"]
        spawner.run(lambda: procs.append(subprocess.Popen(with_parent_death(argv))))

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
        from moe_lightning.children import spawner, with_parent_death
        argv = [sys.executable, "-c", "import time; time.sleep(60)"]
        kids = [spawner.run(lambda: subprocess.Popen(with_parent_death(argv), start_new_session=True))
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


def _services(up: UpProcess) -> dict[str, int]:
    """Service name -> pid of the up process's children (from their `python -m <module>`)."""
    from moe_lightning.launcher import SERVICES

    modules = {kind.module: name for name, kind in SERVICES.items()}
    out = {}
    for child in _children(up.proc.pid):
        argv = _cmdline(child)
        if "-m" in argv and argv[argv.index("-m") + 1] in modules:
            out[modules[argv[argv.index("-m") + 1]]] = child
    return out


@pytest.mark.skipif(not LINUX, reason="PR_SET_PDEATHSIG is Linux's")
def test_kill_9_of_up_leaves_no_service_running(tiny_model: Path, tmp_path: Path) -> None:
    up = UpProcess(tiny_model, f"k9{os.getpid()}", tmp_path / "logs", "--no-restart")
    try:
        assert up.proc.stdout is not None
        line = up.proc.stdout.readline()
        assert line, up.proc.stderr.read() if up.proc.stderr else ""
        pids = [int(e["pid"]) for e in json.loads(line).values()]
        assert len(pids) == 5 and all(not _gone(p) for p in pids)  # the four services and the HTTP gateway
        t0 = time.monotonic()
        up.proc.kill()  # nothing of `up` runs now: no stop(), no finally
        up.proc.wait()
        left = _wait_gone(pids, 20)
        assert left == [], f"still running after up was killed: {left}\n{_left_behind(left, tmp_path / 'logs')}"
        print(f"every service gone {time.monotonic() - t0:.1f} s after kill -9 of up")
        # each ended on its own, not by exit_process's watchdog (which would hide a hang at exit)
        stalled = [log.name for log in (tmp_path / "logs").glob("**/*.log") if "exit_stalled" in log.read_text()]
        assert stalled == [], f"ended by the exit watchdog: {stalled}\n{_left_behind([], tmp_path / 'logs')}"
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
    up = UpProcess(tiny_model, f"st{os.getpid()}", tmp_path / "logs", "--no-restart")
    held = None
    try:
        deadline = time.monotonic() + 60
        while len(services := _services(up)) < 5 and up.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(services) == 5, f"services seen: {services}"  # the four and the HTTP gateway
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
