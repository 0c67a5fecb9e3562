"""Mixtral (MixtralForCausalLM): the paper's model. GQA, RMSNorm, top-k router whose weights it always
renormalises, experts as w1 (gate) / w3 (up) / w2 (down) under `block_sparse_moe` in released
checkpoints (transformers 5 saves them fused under `mlp`)."""

from __future__ import annotations

from typing import Any

from moe_lightning.families.family import HF_TOP_NAMES, MLP_NAMES, Family, MoeNames, hf_layout_family
from moe_lightning.hf_configs import common_fields, eos_ids, require
from moe_lightning.spec import ModelSpec

ARCHITECTURE = "MixtralForCausalLM"


def read_config(config: dict[str, Any], arch: str) -> dict[str, Any]:
    return dict(
        **common_fields(config, arch, 1_000_000.0, 1e-5),
        intermediate_size=int(require(config, "intermediate_size")),
        num_experts=int(require(config, "num_local_experts")),
        norm_topk_prob=True,  # Mixtral always renormalises its top-k weights
        sliding_window=config.get("sliding_window"),
        eos_token_ids=eos_ids(config.get("eos_token_id", 2)),
    )


MOE_NAMES = (MoeNames("block_sparse_moe", "w1", "w3", "w2"), MLP_NAMES)  # released, then transformers 5's


load_layer, random_weights = hf_layout_family(MOE_NAMES)


def demo_config(preset: dict[str, Any], dtype: str) -> dict[str, Any]:
    """A Mixtral config.json with `preset`'s shapes (presets are written in Mixtral's field names)."""
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "mixtral",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "sliding_window": None,
        "initializer_range": 0.02,
        "dtype": dtype,
    }
    config.update(preset)
    return config


PLAN_PRESETS = {
    # mistralai/Mixtral-8x7B-v0.1: 46.7 B parameters
    "mixtral-8x7b": ModelSpec(
        architecture=ARCHITECTURE,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        num_experts=8,
        top_k=2,
        vocab_size=32000,
        max_position_embeddings=32768,
        dtype="bfloat16",
    ),
    # mistralai/Mixtral-8x22B-v0.1: 141 B parameters
    "mixtral-8x22b": ModelSpec(
        architecture=ARCHITECTURE,
        hidden_size=6144,
        intermediate_size=16384,
        num_layers=56,
        num_heads=48,
        num_kv_heads=8,
        head_dim=128,
        num_experts=8,
        top_k=2,
        vocab_size=32768,
        max_position_embeddings=65536,
        dtype="bfloat16",
    ),
}

FAMILY = Family(
    name="mixtral",
    architecture=ARCHITECTURE,
    model_type="mixtral",
    read_config=read_config,
    load_layer=load_layer,
    top_names=HF_TOP_NAMES,
    demo_config=demo_config,
    random_weights=random_weights,
    plan_presets=PLAN_PRESETS,
)
