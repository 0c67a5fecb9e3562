"""The host KV cache in the weights' precision: a bf16 stack (arena and KV cache in bf16, attention in fp32
over it) gives transformers' bf16 greedy tokens, and says which dtype its cache holds."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.launcher import Stack
from moe_lightning.spec import ModelSpec

from reference import E2E_PROMPTS, hf_generate

PROMPTS = E2E_PROMPTS[:6]  # bf16 matmuls are emulated on AVX2 CPUs: few prompts, few tokens
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def bf16_reference(hf_dir: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    return hf_generate(hf, PROMPTS, NEW_TOKENS)


def test_bf16_stack_gives_transformers_bf16_tokens(
    hf_dir: Path, bf16_reference: list[list[int]], make_stack: Callable[..., Stack]
) -> None:
    stack = make_stack(
        dtype="bfloat16",
        kv_dtype="auto",  # the arena's: bf16
        kv_cache_memory="8MiB",
        micro_batch_size=3,  # ragged micro-batches, prefill split across them
        timeout=600,  # the launcher's own default start-up limit
    )
    with GenerationClient(stack.api_address, timeout=300) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=NEW_TOKENS) for p in PROMPTS])
        meta = c.server_metadata()
    stack.stop()
    assert [d.token_ids for d in done] == bf16_reference
    assert meta.kv_cache_dtype == "bfloat16"
    spec = ModelSpec.from_pretrained(hf_dir)
    per_block = PagedKVCache.bytes_per_block(spec, 16, torch.bfloat16)  # half an fp32 block: twice the tokens
    assert meta.kv_cache_tokens == (8 << 20) // per_block * 16
    lines = (stack.config.log_dir / "orchestrator.log").read_text().splitlines()
    planned = next(json.loads(x) for x in lines if '"planned"' in x)
    assert planned["kv_cache_dtype"] == "bfloat16"
    # by need (the default admission) a sequence holds s + n/2 on average, not its whole s + n
    # (--expected-prompt/gen-len; docs/hrm.md, "The KV rule")
    assert planned["kv_admission"] == "need" and planned["kv_cache_tokens"] == meta.kv_cache_tokens
    assert planned["kv_cache_sequences"] > meta.kv_cache_tokens // (77 + 64)
    # a 16-bit q over its own cache attends in sdpa's 16-bit kernel: the native fp32 one is neither built
    # nor loaded (a bf16 GPU run's start once paid 20-40 s of the GPU check's preflight compiling it)
    attention = [json.loads(x) for x in (stack.config.log_dir / "cpu_attention.log").read_text().splitlines()]
    native = next(x for x in attention if x.get("event") == "native_kernels")
    assert native["decode_attention"] == "pytorch" and "sdpa" in native["reason"], native
    assert next(x for x in attention if x.get("event") == "serving")["decode_attention"] == "pytorch"
    assert stack.leaked_segments() == []
