"""Mixed steps and grouped experts through real processes: decodes and prompt chunks in one weight
pass, prompts longer than the prefill budget spanning steps, a layer's experts once per group of
micro-batches, exact against transformers in every placement."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.launcher import Stack

from reference import E2E_PROMPTS, device_budget


def metric(stack: Stack, name: str, service: str = "orchestrator") -> float:
    text = urllib.request.urlopen(stack.endpoints()[service]["metrics"], timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(m[1]) if m else 0.0


def steps_run(stack: Stack) -> float:
    return sum(metric(stack, f'moe_lightning_step_seconds_count{{kind="{k}"}}') for k in ("prefill", "decode", "mixed"))


PLACEMENTS = [("cpu", "gpu"), ("gpu", "gpu"), ("cpu", "cpu")]


@pytest.mark.parametrize(
    ("attention", "experts", "groups"),
    [(a, e, g) for g in (0, 2) for a, e in PLACEMENTS] + [("cpu", "gpu", 1)],
)
def test_mixed_steps_with_chunked_prompts_match_transformers(
    attention: str, experts: str, groups: int, hf_dir: Path, reference: dict, make_stack: Callable[..., Stack]
) -> None:
    """Prompt chunks of a budget of 5 tokens (every prompt but the shortest spans steps) beside four
    decode micro-batches a step (10 sequences, 3 a micro-batch), experts streamed through a ring of 7
    slots: once per micro-batch (0), or once per group (the device then runs at most `groups` FFN passes
    a layer a step)."""
    from moe_lightning.spec import ModelSpec

    stack = make_stack(
        prefill_budget=5,
        micro_batch_size=3,
        expert_groups=groups,
        device_memory=str(device_budget(hf_dir, 7) + (8 << 20 if attention == "gpu" else 0)),
        device_kv_memory="8MiB" if attention == "gpu" else None,
        attention_placement=attention,
        experts_placement=experts,
    )
    with GenerationClient(stack.api_address, timeout=300) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=14) for p in E2E_PROMPTS])
    assert [d.token_ids for d in done] == [reference[i] for i in range(len(E2E_PROMPTS))]
    assert metric(stack, 'moe_lightning_step_seconds_count{kind="mixed"}') > 0
    assert metric(stack, "moe_lightning_expert_groups") == groups
    if groups:
        passes = metric(stack, "moe_lightning_expert_ffn_passes_total", "gpu_expert")
        layers = ModelSpec.from_pretrained(hf_dir).num_layers
        assert 0 < passes <= groups * layers * steps_run(stack)


def test_the_alternating_schedule_stays_available_and_exact(
    hf_dir: Path, reference: dict, make_stack: Callable[..., Stack]
) -> None:
    from moe_lightning.spec import ModelSpec

    stack = make_stack(step_schedule="alternating", micro_batch_size=3, expert_groups=0)
    with GenerationClient(stack.api_address, timeout=300) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=14) for p in E2E_PROMPTS])
    assert [d.token_ids for d in done] == [reference[i] for i in range(len(E2E_PROMPTS))]
    assert metric(stack, 'moe_lightning_step_seconds_count{kind="mixed"}') == 0
    # once per micro-batch: a step of more than 3 sequences (micro-batches of 3) runs several passes a layer,
    # where one group would run one
    passes = metric(stack, "moe_lightning_expert_ffn_passes_total", "gpu_expert")
    layers = ModelSpec.from_pretrained(hf_dir).num_layers
    assert passes > layers * steps_run(stack)
