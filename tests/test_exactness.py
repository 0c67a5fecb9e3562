"""Our stage pipeline against transformers' MixtralForCausalLM: a ragged batch, prefill + 16 greedy
decode steps, logits within 1e-4 x max(1, max|logit|) at every step and identical tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_lightning.checkpoint import load_model_weights
from moe_lightning.engine import InProcessEngine
from moe_lightning.request import GenerationRequest
from moe_lightning.spec import ModelSpec

from reference import assert_engine_matches, hf_greedy, load_hf, save_hf_mixtral

STEPS = 17  # the prefill's token + 16 decode steps

CONFIGS = {
    # head_dim 32 != hidden / heads, 4:1 GQA, 6 experts top-3
    "gqa4_top3": dict(
        vocab_size=384,
        hidden_size=96,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        num_local_experts=6,
        num_experts_per_tok=3,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # plain multi-head attention, 8 experts top-1, a sliding window shorter than the contexts
    "mha_top1_window": dict(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=3,
        num_local_experts=8,
        num_experts_per_tok=1,
        max_position_embeddings=256,
        sliding_window=12,
    ),
}

PROMPTS = [
    [1, 17, 42, 99, 7, 3, 250, 11, 5, 8, 13, 21, 34],
    [1, 200],
    [1, 5, 6, 7, 8, 9, 10],
    [1, 66, 77, 88, 99, 111, 122, 133, 144, 155, 166, 177, 188, 199, 210, 220, 230, 240, 250, 260],
    [1, 3, 3, 3],
]


@pytest.fixture(scope="module", params=["tiny", *CONFIGS])
def model_dir(request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "tiny":
        return tiny_model
    return save_hf_mixtral(tmp_path_factory.mktemp(request.param), seed=1, **CONFIGS[request.param])


@pytest.mark.parametrize("block_size", [4, 16])
def test_ragged_batch_matches_transformers(model_dir: Path, block_size: int) -> None:
    spec = ModelSpec.from_pretrained(model_dir)
    weights = load_model_weights(model_dir, spec, progress=False)
    engine = InProcessEngine(spec, weights, block_size=block_size, kv_shuffle_seed=block_size)
    hf = load_hf(model_dir)
    assert_engine_matches(engine, PROMPTS, STEPS, [hf_greedy(hf, p, STEPS) for p in PROMPTS])


def test_greedy_generate_matches_transformers_generate(tiny_model: Path) -> None:
    """The same check through transformers' own generate() loop (its KV cache, its stopping)."""
    spec = ModelSpec.from_pretrained(tiny_model)
    engine = InProcessEngine(spec, load_model_weights(tiny_model, spec, progress=False))
    hf = load_hf(tiny_model)
    for prompt in PROMPTS[:3]:
        [ours], _ = engine.generate([GenerationRequest(prompt, max_new_tokens=12, ignore_eos=True)])
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
        assert ours.token_ids == out[0, len(prompt) :].tolist()
