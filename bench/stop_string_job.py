"""The job bench/kv_by_need.py and bench/step_schedules.py run: prompts sampled at temperature 1 with
a seed per row and cut by stop strings, so that they end at lengths no scheduler knows in advance."""

from __future__ import annotations

from collections.abc import Callable

from moe_lightning.client import Prompt


def stop_string_job(rows: int, prompt_len: Callable[[int], int], max_new: int, stops: list[str]) -> list[Prompt]:
    """`rows` prompts, row i of prompt_len(i) tokens (a BOS, then a fixed pattern over the vocabulary)."""
    return [
        Prompt(
            token_ids=[1, *(3 + (i * 31 + j * 7) % 500 for j in range(prompt_len(i)))],
            max_new_tokens=max_new,
            temperature=1.0,
            seed=i,
            stop=stops,
        )
        for i in range(rows)
    ]
