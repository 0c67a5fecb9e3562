"""Faults on a live stack, not in process (issue 27, item 12): `up` whose reader left before it even
started (its stdout and stderr pipes closed) goes on serving, its services too; a scheduler loop that
dies makes the live orchestrator NOT_SERVING (gRPC health and the gateway's /health) and fails what
was in flight and what comes after with UNAVAILABLE, never a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from moe_lightning.children import free_port
from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.launcher import Stack
from moe_lightning.service.names import GENERATION as API
from moe_lightning.service.upstream import health_status, open_channel

from processes import wait_serving

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_up_whose_pipes_are_closed_at_start_keeps_serving(tiny_model: Path) -> None:
    port, http_port = free_port(), free_port()
    argv = [sys.executable, "-m", "moe_lightning.cli", "up", "--model", str(tiny_model), "--device", "cpu"]
    argv += ["--port", str(port), "--http-port", str(http_port), "--kv-cache-memory", "32MiB"]
    # no --log-dir: the services inherit the same dead pipes and log into them all along
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    proc.stderr.close()
    try:
        wait_serving(f"127.0.0.1:{port}", timeout=150)
        time.sleep(1.0)  # `up` has written its endpoints into the closed pipe by now
        assert proc.poll() is None, f"up exited with {proc.returncode} once its reader was gone"
        with GenerationClient(f"127.0.0.1:{port}") as client:  # every service logs a request's lines
            out = client.generate(Prompt(text="Hello there", max_new_tokens=4, ignore_eos=True))
        assert out.completion_tokens == 4
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10) as r:
            assert r.status == 200
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0  # a clean stop, not "Broken pipe"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# Loaded by every service of the stack below (sitecustomize on PYTHONPATH); only the orchestrator has a
# Scheduler. Its loop thread ends with an error that no guard inside a turn can catch once the trigger
# file exists: the way a loop dies when its guards fail themselves.
SITECUSTOMIZE = """
import os
from pathlib import Path

TRIGGER = Path(os.environ["MOE_LIGHTNING_TEST_KILL_LOOP"])


class LoopKilled(BaseException):
    pass


def _patch():
    from orchestrator import scheduler

    turn = scheduler.Scheduler._turn

    def dying_turn(self):
        if TRIGGER.exists():
            raise LoopKilled("killed by the test")
        return turn(self)

    scheduler.Scheduler._turn = dying_turn


import sys
if any("orchestrator" in a for a in sys.orig_argv):
    _patch()
"""


def test_a_scheduler_loop_that_dies_turns_the_live_orchestrator_not_serving(
    make_stack: Callable[..., Stack], tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    trigger = tmp_path / "kill-the-loop"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ["PYTHONPATH"]]))
    monkeypatch.setenv("MOE_LIGHTNING_TEST_KILL_LOOP", str(trigger))
    stack = make_stack(model=tiny_model, http_port=0, kv_cache_memory="32MiB")
    addr = stack.api_address
    http = stack.endpoints()["gateway"]["http"]
    with GenerationClient(addr) as client:
        assert client.generate(Prompt(text="Hello", max_new_tokens=2, ignore_eos=True)).completion_tokens == 2

        errors: list[BaseException] = []

        def long_request() -> None:
            try:
                client.generate(Prompt(text="Hello", max_new_tokens=1000, ignore_eos=True))
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.0)  # it is running
        trigger.touch()
        t.join(30)
        assert not t.is_alive(), "a request in flight hung on a dead loop"
        assert errors and isinstance(errors[0], grpc.RpcError)
        assert errors[0].code() == grpc.StatusCode.UNAVAILABLE and "scheduler stopped" in errors[0].details()

        ch = open_channel(addr)
        deadline = time.monotonic() + 15
        while health_status(ch, API, timeout=1.0) != NOT_SERVING:
            assert time.monotonic() < deadline, "health still SERVING with the scheduler loop dead"
            time.sleep(0.2)
        ch.close()
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"{http}/health", timeout=10)
        assert info.value.code == 503

        with pytest.raises(grpc.RpcError) as refused:
            client.generate(Prompt(text="Hello", max_new_tokens=2))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
