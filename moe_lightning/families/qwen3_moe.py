"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen2-MoE's layout without QKV biases or a shared expert, with
RMSNorm of q and k per head and a head_dim of its own (not hidden / heads)."""

from __future__ import annotations

from typing import Any

from moe_lightning.families.family import HF_TOP_NAMES, Family, hf_layout_family
from moe_lightning.families.qwen2_moe import qwen_demo_config, qwen_moe_fields
from moe_lightning.spec import ModelSpec

ARCHITECTURE = "Qwen3MoeForCausalLM"


def read_config(config: dict[str, Any], arch: str) -> dict[str, Any]:
    return qwen_moe_fields(config, arch, qk_norm="head")


load_layer, random_weights = hf_layout_family()


def demo_config(preset: dict[str, Any], dtype: str) -> dict[str, Any]:
    return qwen_demo_config(
        preset,
        dtype,
        architectures=[ARCHITECTURE],
        model_type="qwen3_moe",
        head_dim=preset.get("head_dim") or preset["hidden_size"] // preset["num_attention_heads"],
        norm_topk_prob=True,
    )


def _qwen3(**shape: Any) -> ModelSpec:
    """A published Qwen3-MoE: what they all share, and `shape`."""
    common = dict(
        architecture=ARCHITECTURE,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        dtype="bfloat16",
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        qk_norm="head",
        bos_token_id=None,
        eos_token_ids=(151645,),
    )
    return ModelSpec(**(common | shape))


PLAN_PRESETS = {
    # Qwen/Qwen3-30B-A3B: 30.5 B parameters (3.3 B active), 128 experts top-8
    "qwen3-30b-a3b": _qwen3(
        hidden_size=2048,
        intermediate_size=768,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        num_experts=128,
        top_k=8,
    ),
    # Qwen/Qwen3-235B-A22B: 235 B parameters (22 B active), 128 experts top-8
    "qwen3-235b-a22b": _qwen3(
        hidden_size=4096,
        intermediate_size=1536,
        num_layers=94,
        num_heads=64,
        num_kv_heads=4,
        num_experts=128,
        top_k=8,
    ),
}

FAMILY = Family(
    name="qwen3-moe",
    architecture=ARCHITECTURE,
    model_type="qwen3_moe",
    read_config=read_config,
    load_layer=load_layer,
    top_names=HF_TOP_NAMES,
    demo_config=demo_config,
    random_weights=random_weights,
    plan_presets=PLAN_PRESETS,
)
