"""OLMoE (OlmoeForCausalLM): RMSNorm of q and k over the whole projection, an optional clip_qkv, and
top-k router weights not renormalised unless norm_topk_prob; the shared HF layout under `mlp`."""

from __future__ import annotations

from typing import Any

from moe_lightning.families import mixtral
from moe_lightning.families.family import HF_TOP_NAMES, Family, hf_layout_family
from moe_lightning.hf_configs import common_fields, eos_ids, require
from moe_lightning.spec import ModelSpec

ARCHITECTURE = "OlmoeForCausalLM"


def read_config(config: dict[str, Any], arch: str) -> dict[str, Any]:
    clip = config.get("clip_qkv")
    return dict(
        **common_fields(config, arch, 10_000.0, 1e-5),
        intermediate_size=int(require(config, "intermediate_size")),  # OLMoE's experts are this wide
        num_experts=int(config.get("num_experts") or require(config, "num_local_experts")),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        eos_token_ids=eos_ids(config.get("eos_token_id")),
        qk_norm="full",
        clip_qkv=None if clip is None else float(clip),
    )


load_layer, random_weights = hf_layout_family()


def demo_config(preset: dict[str, Any], dtype: str) -> dict[str, Any]:
    config = mixtral.demo_config(preset, dtype)
    config.pop("sliding_window", None)
    config.update(
        architectures=[ARCHITECTURE],
        model_type="olmoe",
        num_experts=config.pop("num_local_experts"),
        norm_topk_prob=False,
        clip_qkv=None,
        rope_theta=10_000.0,
    )
    return config


PLAN_PRESETS = {
    # allenai/OLMoE-1B-7B-0924: 6.9 B parameters (1.3 B active), 64 experts top-8
    "olmoe-1b-7b": ModelSpec(
        architecture=ARCHITECTURE,
        hidden_size=2048,
        intermediate_size=1024,
        num_layers=16,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        num_experts=64,
        top_k=8,
        vocab_size=50304,
        max_position_embeddings=4096,
        dtype="bfloat16",
        rope_theta=10000.0,
        norm_topk_prob=False,
        qk_norm="full",
        bos_token_id=None,
        eos_token_ids=(50279,),
    ),
}

FAMILY = Family(
    name="olmoe",
    architecture=ARCHITECTURE,
    model_type="olmoe",
    read_config=read_config,
    load_layer=load_layer,
    top_names=HF_TOP_NAMES,
    demo_config=demo_config,
    random_weights=random_weights,
    plan_presets=PLAN_PRESETS,
)
