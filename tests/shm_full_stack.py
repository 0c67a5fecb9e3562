"""Run by test_shm_full_e2e.py inside a private mount namespace whose /dev/shm is a small tmpfs of its
own: a stack on it, and another local user (nobody) filling that /dev/shm with `dd`. Prints one JSON
line of what happened, for the test to judge.

Modes: `fill` -- a started stack, filled up while requests run, then a kill -9 of cpu_attention whose
successor finds no room until the filler's files are removed; `small` -- a start on a /dev/shm too
small for the KV cache.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import grpc

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.config.stack import StackConfig
from moe_lightning.launcher import Stack, StackError
from moe_lightning.shm.pages import SHM_DIR, shm_free
from moe_lightning.shm.segment import list_segments, sweep_stale

from processes import wait_serving
from reference import E2E_PROMPTS as PROMPTS

IN_FLIGHT_TOKENS = 60
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def fill(name: str) -> int:
    """Another user's file takes every byte /dev/shm has left (dd stops at ENOSPC); the bytes left."""
    subprocess.run([*NOBODY, "dd", "if=/dev/zero", f"of={SHM_DIR / name}", "bs=1M"], capture_output=True)
    return shm_free()


def outcome(r: object) -> object:
    if isinstance(r, grpc.RpcError):
        return {"code": r.code().name, "details": r.details()}
    return list(r.token_ids)


def answer(stack: Stack, prompt: list[int]) -> object:
    try:
        with GenerationClient(stack.api_address, timeout=60) as c:
            return outcome(c.generate(Prompt(token_ids=prompt, max_new_tokens=IN_FLIGHT_TOKENS, ignore_eos=True)))
    except grpc.RpcError as exc:
        return outcome(exc)


def answers(stack: Stack, timeout: float = 60) -> object:
    try:
        with GenerationClient(stack.api_address, timeout=timeout) as c:
            done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=14) for p in PROMPTS])
        return [list(d.token_ids) for d in done]
    except grpc.RpcError as exc:
        return outcome(exc)


def small(stack: Stack, report: dict[str, object]) -> None:
    t0 = time.monotonic()
    try:
        stack.start(timeout=300)
    except StackError as exc:
        report["refused"] = str(exc)
    report["seconds"] = time.monotonic() - t0


def step(what: str) -> None:
    """A line on stderr per stage: a helper that fails shows how far it got, and when."""
    sys.stderr.write(f"shm_full_stack: {time.strftime('%H:%M:%S')} {what}\n")
    sys.stderr.flush()


def filled(stack: Stack, report: dict[str, object]) -> None:
    step("starting the stack")
    stack.start(timeout=300)
    step("filling /dev/shm")
    report["before"] = answers(stack)
    with ThreadPoolExecutor(4) as pool:  # decoding, into KV blocks not touched yet, while the filler runs
        running = [pool.submit(answer, stack, p) for p in PROMPTS[:4]]
        time.sleep(0.5)
        report["free_after_fill"] = fill("filler")
        report["new"] = answers(stack)
        report["in_flight"] = [r.result() for r in running]
    report["exits"] = {name: p.poll() for name, p in stack.procs.items()}  # None: still running
    if any(code is not None for code in report["exits"].values()):
        return  # a service died of it: the test says which, and how
    step("killing cpu_attention, filling /dev/shm again")

    # cpu_attention dies (kill -9) and its successor finds no room: up's supervisor waits, not gives up
    victim = stack.procs["cpu_attention"]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    sweep_stale(stack.config.run_id, owner="cpu_attention")  # its cache's pages go back ...
    report["free_after_refill"] = fill("filler2")  # ... and the other user takes them
    stack.supervise()
    deadline = time.monotonic() + 60
    while not stack.shm_waits["cpu_attention"] and time.monotonic() < deadline:
        time.sleep(0.2)
    report["shm_waits"] = len(stack.shm_waits["cpu_attention"])
    step("asking while short")
    report["while_short"] = answers(stack, timeout=20)
    report["gave_up"] = list(stack.gave_up)
    for name in ("filler", "filler2"):
        (SHM_DIR / name).unlink()
    step("filler gone: waiting for SERVING")
    t0 = time.monotonic()
    wait_serving(stack.api_address, 180)
    report["recovered_seconds"] = time.monotonic() - t0  # the next try (back-off 2 s) and its start
    report["after"] = answers(stack)
    report["restarts"] = {name: len(times) for name, times in stack.restarts.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["fill", "small"])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--log-dir", type=Path, required=True)
    p.add_argument("--kv-cache-memory", default="32MiB")
    args = p.parse_args()
    config = StackConfig(
        model=args.model,
        port=0,
        kv_cache_memory=args.kv_cache_memory,
        max_batch_size=8,
        run_id=f"shm{os.getpid()}",
        log_dir=args.log_dir,
    )
    stack = Stack(config)
    report: dict[str, object] = {}
    try:
        (small if args.mode == "small" else filled)(stack, report)
    except Exception as exc:  # the report so far, and what stopped it, for the test to show
        report["failed"] = repr(exc)
    finally:
        stack.stop()
    report["leaked"] = list_segments(config.run_id)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
