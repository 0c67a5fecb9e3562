"""Mixed steps through real processes: decodes and prompt chunks in one weight pass, prompts longer
than the prefill budget spanning steps, exact against transformers in every placement."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.launcher import Stack

from reference import E2E_PROMPTS, device_budget


def metric(stack: Stack, name: str) -> float:
    text = urllib.request.urlopen(stack.endpoints()["orchestrator"]["metrics"], timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(m[1]) if m else 0.0


@pytest.mark.parametrize(("attention", "experts"), [("cpu", "gpu"), ("gpu", "gpu"), ("cpu", "cpu")])
def test_mixed_steps_with_chunked_prompts_match_transformers(
    attention: str, experts: str, hf_dir: Path, reference: dict, make_stack: Callable[..., Stack]
) -> None:
    stack = make_stack(
        prefill_budget=5,  # every prompt but the shortest spans steps, beside the others' decodes
        micro_batch_size=3,
        device_memory=str(device_budget(hf_dir, 7) + (8 << 20 if attention == "gpu" else 0)),
        device_kv_memory="8MiB" if attention == "gpu" else None,
        attention_placement=attention,
        experts_placement=experts,
    )
    with GenerationClient(stack.api_address, timeout=300) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=14) for p in E2E_PROMPTS])
    assert [d.token_ids for d in done] == [reference[i] for i in range(len(E2E_PROMPTS))]
    assert metric(stack, 'moe_lightning_step_seconds_count{kind="mixed"}') > 0


def test_the_alternating_schedule_stays_available_and_exact(
    hf_dir: Path, reference: dict, make_stack: Callable[..., Stack]
) -> None:
    stack = make_stack(step_schedule="alternating")
    with GenerationClient(stack.api_address, timeout=300) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=14) for p in E2E_PROMPTS])
    assert [d.token_ids for d in done] == [reference[i] for i in range(len(E2E_PROMPTS))]
    assert metric(stack, 'moe_lightning_step_seconds_count{kind="mixed"}') == 0
