"""Shared by the benchmarks: run one batch through a fresh stack and diff its metrics around it."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_lightning.client import Completion, GenerationClient, Prompt
from moe_lightning.launcher import Stack, StackConfig

SERVICES = ("orchestrator", "gpu_expert", "cpu_attention")


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m[1]] = float(m[2])
    return out


def random_prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[1, *torch.randint(3, vocab, (prompt_len - 1,), generator=g).tolist()] for _ in range(batch)]


@dataclass
class StackRun:
    done: list[Completion]
    wall_seconds: float
    delta: Callable[[str, str], float]  # (service, series) -> increase during the batch


def run_batch(model: Path, batch: list[list[int]], gen: int, run_id: str, threads: int = 0) -> StackRun:
    cfg = StackConfig(
        model=model,
        run_id=run_id,
        port=0,
        max_batch_size=len(batch),
        kv_cache_memory="4GiB",
        log_dir=Path(f"/tmp/moe-lightning-bench-{run_id}"),
        cache_dir=model.parent / "arena-cache",
        threads={"gpu_expert": threads, "cpu_attention": threads} if threads else {},
    )
    s = Stack(cfg)
    s.start()
    try:
        ep = s.endpoints()
        with GenerationClient(s.api_address, timeout=3600) as c:
            c.batch_generate([Prompt(token_ids=batch[0][:8], max_new_tokens=2, ignore_eos=True)])  # warm-up
            before = {n: scrape(ep[n]["metrics"]) for n in SERVICES}
            t0 = time.perf_counter()
            done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=gen, ignore_eos=True) for p in batch])
            wall = time.perf_counter() - t0
            after = {n: scrape(ep[n]["metrics"]) for n in SERVICES}
    finally:
        s.stop()
    return StackRun(done, wall, lambda svc, key: after[svc].get(key, 0.0) - before[svc].get(key, 0.0))
