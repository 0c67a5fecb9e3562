"""The pieces of bench/gpu_check.py (the H200 check of issue 5): the device budget rule, the
workload, the accelerate-offload baseline, the phase subprocesses and the phase runner."""

from __future__ import annotations

import sys
import time


def log(msg: str) -> None:
    sys.stderr.write(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()
