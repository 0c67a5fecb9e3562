"""Our processes as tests start them: `moe-lightning up` as a user runs it (its endpoints line,
signals), and a weight store run once to see how it fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


class UpProcess:
    def __init__(self, model: Path, run_id: str, log_dir: Path, *extra: str) -> None:
        self.run_id = run_id
        self.endpoints: dict[str, Any] = {}
        argv = [sys.executable, "-m", "moe_lightning.cli", "up", "--model", str(model), "--port", "0", "--json"]
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
