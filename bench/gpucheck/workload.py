"""The prompts every system of the check gets: exactly `moe-lightning bench --workload mtbench`'s."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any


def bench_prompts(model: Path, vocab: int, n: int) -> list[list[int]]:
    """Exactly the prompts `moe-lightning bench --workload mtbench --num-prompts n` sends (its own
    function), so every system sees the same token ids."""
    from moe_lightning.commands import bench_runs

    return bench_runs.bench_prompts(argparse.Namespace(workload="mtbench", num_prompts=n, model=model), vocab)


def prompts_digest(prompts: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


def describe_workload(model: Path, vocab: int, n: int, gen_len: int) -> dict[str, Any]:
    """What the report says of the prompts: their count, lengths and digest (every system's must match)."""
    prompts = bench_prompts(model, vocab, n)
    lengths = [len(p) for p in prompts]
    return {
        "kind": "mtbench",
        "prompts": n,
        "gen_len": gen_len,
        "average_prompt_tokens": sum(lengths) / n,
        "longest_prompt_tokens": max(lengths),
        "prompts_sha256": prompts_digest(prompts),
    }
