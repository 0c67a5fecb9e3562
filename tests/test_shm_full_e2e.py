"""Another local user fills /dev/shm (issue 54, H5): no service dies of SIGBUS, since every segment's
pages were committed when it was made; a start short of shared memory fails at once saying so, and
under `up`'s supervisor it is tried again with back-off until the space is back.

Each test runs the stack in a private mount namespace (`unshare -m`) whose /dev/shm is a small tmpfs
of its own (tests/shm_full_stack.py), filled by `dd` as the user nobody: the machine's /dev/shm and
other stacks are not touched. It needs root (to mount); elsewhere it is skipped, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reference import E2E_PROMPTS as PROMPTS

HELPER = Path(__file__).with_name("shm_full_stack.py")
SIGBUS_EXIT = -7  # Popen.returncode of a process killed by SIGBUS


def _namespace_problem() -> str | None:
    """Why a private /dev/shm cannot be made here, or None."""
    if os.geteuid() != 0:
        return "mounting a private /dev/shm needs root (unshare -m, mount -t tmpfs)"
    missing = [tool for tool in ("unshare", "setpriv", "dd", "mount") if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)}"
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"unshare/mount not permitted here: {probe.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def private_shm() -> None:
    problem = _namespace_problem()
    if problem is not None:
        pytest.skip(problem)


def _run(mode: str, shm_size: str, model: Path, log_dir: Path, *extra: str) -> dict:
    mount = f"mount -t tmpfs -o size={shm_size},mode=1777 tmpfs /dev/shm"
    helper = " ".join([sys.executable, str(HELPER), mode, "--model", str(model), "--log-dir", str(log_dir), *extra])
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", f"{mount} && exec {helper}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"helper failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    report = json.loads(done.stdout.strip().splitlines()[-1])
    report["stderr"] = done.stderr
    assert "failed" not in report, f"{report}\n{done.stderr[-6000:]}"
    assert report["leaked"] == [], report["leaked"]
    return report


def test_a_full_dev_shm_never_kills_a_service_and_a_start_waits_for_room(
    private_shm: None, hf_dir: Path, reference: dict, tmp_path: Path
) -> None:
    want = [reference[i] for i in range(len(PROMPTS))]
    r = _run("fill", "256m", hf_dir, tmp_path)
    assert r["before"] == want
    assert r["free_after_fill"] < 1 << 20, "the filler did not fill /dev/shm"
    # committed pages: the stack goes on as if nothing happened, requests in flight and new ones
    assert r["exits"] == {name: None for name in r["exits"]}, f"a service died (SIGBUS is {SIGBUS_EXIT}): {r}"
    assert r["new"] == want
    assert all(isinstance(x, list) and len(x) == 60 for x in r["in_flight"]), r["in_flight"]
    # a successor with no room: refused while short (the API says the backend is down), retried, not given up
    assert r["free_after_refill"] < 1 << 20
    assert r["shm_waits"] >= 1 and r["gave_up"] == []
    assert r["while_short"]["code"] == "UNAVAILABLE", r["while_short"]
    assert "could not get shared memory (/dev/shm has" in r["stderr"] and "the KV cache needs 32.0 MiB" in r["stderr"]
    assert r["restarts"]["cpu_attention"] == 1  # the kill only: waiting for room is no crash
    # the space back: serving again, exactly
    assert r["after"] == want, r


def test_a_start_on_too_small_a_dev_shm_fails_at_once_saying_so(
    private_shm: None, hf_dir: Path, tmp_path: Path
) -> None:
    r = _run("small", "24m", hf_dir, tmp_path, "--kv-cache-memory", "32MiB")
    assert "refused" in r, "the stack started on a /dev/shm smaller than its KV cache"
    assert "cpu_attention exited with code 75 (too little shared memory)" in r["refused"]
    assert "the KV cache needs 32.0 MiB: free space in /dev/shm or pass a smaller --kv-cache-memory" in r["refused"]
    assert r["seconds"] < 60
