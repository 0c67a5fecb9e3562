"""The paper's operating point on this machine: thousands of sequences decoded together, in tens of
micro-batches (and, the other extreme, a thousand in one), every expert streamed through a ring of
buffer slots, through the four real processes. Every sequence's greedy tokens equal the in-process
engine's, and a sample equals transformers'."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moe_lightning.checkpoint import load_model_weights
from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.engine import InProcessEngine
from moe_lightning.launcher import Stack
from moe_lightning.request import GenerationRequest
from moe_lightning.spec import ModelSpec

from reference import device_budget, hf_greedy, load_hf

GEN = 6


def _prompts(spec: ModelSpec, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 13, (n,), generator=g).tolist()
    return [torch.randint(3, spec.vocab_size, (k,), generator=g).tolist() for k in lengths]


def _metric(stack: Stack, service: str, pattern: str) -> list[tuple[str, float]]:
    with urllib.request.urlopen(stack.endpoints()[service]["metrics"], timeout=10) as r:
        text = r.read().decode()
    return [(m[1], float(m[2])) for m in re.finditer(rf"^{pattern}(\S*) (\S+)$", text, re.M)]


@pytest.mark.parametrize(
    ("sequences", "micro_batch"),
    [(2048, 128), (1024, 0)],
    ids=["2048-in-16-micro-batches", "1024-in-one-micro-batch"],
)
def test_thousands_of_sequences_with_every_expert_streamed_are_exact(
    tiny_model: Path, make_stack: Callable[..., Stack], sequences: int, micro_batch: int
) -> None:
    spec = ModelSpec.from_pretrained(tiny_model)
    prompts = _prompts(spec, sequences, seed=sequences)
    stack = make_stack(
        model=tiny_model,
        kv_cache_memory="128MiB",
        max_batch_size=sequences,
        micro_batch_size=micro_batch,
        # 7 buffer slots for the 8 experts: none resident, every one streamed each step
        device_memory=str(device_budget(tiny_model, ring=7)),
        experts_placement="gpu",
    )
    with GenerationClient(stack.api_address, timeout=600) as c:
        done = c.batch_generate_all(
            [Prompt(token_ids=p, max_new_tokens=GEN, ignore_eos=True) for p in prompts], chunk_size=256
        )
    decode_sizes = _metric(stack, "orchestrator", "moe_lightning_decode_batch_size_bucket")
    handoffs = dict(_metric(stack, "gpu_expert", "moe_lightning_handoffs_total"))
    streamed = _metric(stack, "gpu_expert", "moe_lightning_expert_bytes_streamed_total")
    ring = _metric(stack, "gpu_expert", "moe_lightning_expert_buffer_slots")
    stack.stop()
    assert stack.leaked_segments() == []

    weights = load_model_weights(tiny_model, spec, progress=False)
    want, _ = InProcessEngine(spec, weights).generate(
        [GenerationRequest(p, max_new_tokens=GEN, ignore_eos=True) for p in prompts]
    )
    assert [d.token_ids for d in done] == [w.token_ids for w in want]
    hf = load_hf(tiny_model)
    for i in range(0, sequences, sequences // 8):  # a sample against transformers itself
        assert done[i].token_ids == hf_greedy(hf, prompts[i], GEN)[0]

    # the whole batch was decoded together, in the micro-batches asked for, with experts streamed
    below_all = dict(decode_sizes)[f'{{le="{2 ** (sequences.bit_length() - 2)}.0"}}']
    total = dict(decode_sizes)['{le="+Inf"}']
    full_steps = total - below_all  # decode steps with more than half the batch (all of it, here)
    assert full_steps >= GEN - 2
    n_ub = max(1, -(-sequences // micro_batch)) if micro_batch else 1
    assert handoffs['{direction="out"}'] >= full_steps * spec.num_layers * n_ub
    assert ring == [("", 7.0)] and streamed[0][1] > 0
