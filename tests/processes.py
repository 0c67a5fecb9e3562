"""Our processes as tests start them: `moe-lightning up` as a user runs it (its endpoints line,
signals), and a weight store run once to see how it fails; what fault tests watch a stack with
(requests in flight, the API's health)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.launcher import Stack
from moe_lightning.service.names import GENERATION as API
from moe_lightning.service.upstream import health_status, open_channel

from reference import E2E_PROMPTS as PROMPTS

SERVING = health_pb2.HealthCheckResponse.SERVING


class UpProcess:
    def __init__(self, model: Path, run_id: str, log_dir: Path, *extra: str) -> None:
        self.run_id = run_id
        self.endpoints: dict[str, Any] = {}
        argv = [sys.executable, "-m", "moe_lightning.cli", "up", "--model", str(model), "--port", "0", "--json"]
        argv += ["--http-port", "0"]  # never the default 8000: another stack on this machine may hold it
        argv += ["--run-id", run_id, "--kv-cache-memory", "32MiB", "--log-dir", str(log_dir), *extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def read_endpoints(self) -> dict[str, Any]:
        """The JSON line `up` prints once every service is SERVING."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"up failed: {self.proc.stderr.read() if self.proc.stderr else ''}")
        self.endpoints = json.loads(line)
        return self.endpoints

    @property
    def addr(self) -> str:
        return self.endpoints["orchestrator"]["grpc"]

    def stop(self, sig: int) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # and its services with it (parent-death signal): a failed test leaves nothing
            raise

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_weight_store(model: Path, run_id: str, sock: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """A weight store on `model` (no converted copy) until it exits: for checkpoints that must fail."""
    argv = [sys.executable, "-m", "services.weight_store", "--model", str(model), "--run-id", run_id, "--no-cache"]
    argv += ["--address", f"unix://{sock}", "--no-progress"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def in_flight(stack: Stack, n: int) -> tuple[list[threading.Thread], list[tuple[float, object]]]:
    """n long greedy requests, each on its own connection; results are (end time, completion or error)."""
    results: list[tuple[float, object]] = []

    def one(p: list[int]) -> None:
        try:
            with GenerationClient(stack.api_address, timeout=60) as c:
                out: object = c.generate(Prompt(token_ids=p, max_new_tokens=400, ignore_eos=True))
        except grpc.RpcError as exc:
            out = exc
        results.append((time.monotonic(), out))

    threads = [threading.Thread(target=one, args=(PROMPTS[i],), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results


def watch_health(address: str, seconds: float) -> list[int | None]:
    """The API's health as its Watch stream reports it (the status now, then every change) for
    `seconds`, or until it reports NOT_SERVING. A stream, not polling: a recovery that took 0.25 s
    fell between two polls of a loaded machine and looked like no NOT_SERVING at all."""
    seen: list[int | None] = []
    ch = open_channel(address)
    stream = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=API), timeout=seconds)
    try:
        for response in stream:
            seen.append(response.status)
            if response.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
    except grpc.RpcError as exc:  # the deadline; or the server went away, said as None
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            seen.append(None)
    finally:
        stream.cancel()
        ch.close()
    return seen


def wait_serving(address: str, timeout: float) -> None:
    ch = open_channel(address)
    deadline = time.monotonic() + timeout
    try:
        while health_status(ch, API, timeout=0.5) != SERVING:
            assert time.monotonic() < deadline, f"not SERVING again within {timeout} s"
            time.sleep(0.1)
    finally:
        ch.close()


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moe_lightning.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def ranks_of(pid: int) -> list[int]:
    """The other ranks: rank 0's child processes (forked from any of its threads)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return children


def wait_for_ranks(pid: int, n: int, timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(found := ranks_of(pid)) != n:
        assert time.monotonic() < deadline, f"rank 0 ({pid}) has {found} children, not {n}"
        time.sleep(0.1)
    return found
