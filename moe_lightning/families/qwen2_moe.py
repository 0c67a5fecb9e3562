"""Qwen2-MoE / Qwen1.5-MoE (Qwen2MoeForCausalLM): QKV biases, an always-on shared expert behind a
sigmoid gate, and dense layers (mlp_only_layers, decoder_sparse_step). The parts Qwen3-MoE shares
(the dense-layer rule, the expert fields) are here too."""

from __future__ import annotations

from typing import Any

from moe_lightning.families import mixtral
from moe_lightning.families.family import HF_TOP_NAMES, Family, hf_layout_family
from moe_lightning.hf_configs import ModelSpecError, common_fields, eos_ids, require
from moe_lightning.spec import ModelSpec

ARCHITECTURE = "Qwen2MoeForCausalLM"


def qwen_moe_fields(config: dict[str, Any], arch: str, **family: Any) -> dict[str, Any]:
    """What Qwen2-MoE and Qwen3-MoE share; `family` adds their differences."""
    layers = int(require(config, "num_hidden_layers"))
    dense = qwen_dense_layers(config, layers)
    if len(dense) == layers:
        raise ModelSpecError(
            f"every layer of this {arch} is dense (mlp_only_layers = {config.get('mlp_only_layers')}, "
            f"decoder_sparse_step = {config.get('decoder_sparse_step')}): it is not a mixture of experts"
        )
    return dict(
        **common_fields(config, arch, 10_000.0, 1e-6),
        intermediate_size=int(require(config, "moe_intermediate_size")),
        # released configs say num_experts; transformers 5 writes num_local_experts
        num_experts=int(config.get("num_experts") or require(config, "num_local_experts")),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        sliding_window=config.get("sliding_window") if config.get("use_sliding_window") else None,
        eos_token_ids=eos_ids(config.get("eos_token_id")),
        dense_layers=dense,
        dense_intermediate_size=int(require(config, "intermediate_size")) if dense else 0,
        **family,
    )


def qwen_dense_layers(config: dict[str, Any], layers: int) -> tuple[int, ...]:
    """transformers' rule: layer i is sparse unless listed in mlp_only_layers or (i + 1) is not a
    multiple of decoder_sparse_step."""
    only = config.get("mlp_only_layers") or []
    step = config.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ModelSpecError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    if not isinstance(only, list) or any(not isinstance(i, int) or not 0 <= i < layers for i in only):
        raise ModelSpecError(f"mlp_only_layers must list layer indices in 0..{layers - 1}, got {only!r}")
    return tuple(i for i in range(layers) if i in only or (i + 1) % step)


def read_config(config: dict[str, Any], arch: str) -> dict[str, Any]:
    return qwen_moe_fields(
        config,
        arch,
        qkv_bias=bool(config.get("qkv_bias", True)),  # Qwen1.5/2-MoE checkpoints always have them
        shared_expert_size=int(config.get("shared_expert_intermediate_size") or 0),
    )


load_layer, random_weights = hf_layout_family()


def qwen_demo_config(preset: dict[str, Any], dtype: str, **family: Any) -> dict[str, Any]:
    """A Qwen-MoE config.json with a preset's shapes; a preset may make some layers dense (by
    default every layer is sparse)."""
    config = mixtral.demo_config(preset, dtype)
    config.pop("sliding_window", None)
    config.update(
        num_experts=config.pop("num_local_experts"),
        moe_intermediate_size=config["intermediate_size"],
        intermediate_size=4 * config["hidden_size"],  # the dense layers' MLP width
        decoder_sparse_step=config.get("decoder_sparse_step", 1),
        mlp_only_layers=config.get("mlp_only_layers", []),
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        **family,
    )
    return config


def demo_config(preset: dict[str, Any], dtype: str) -> dict[str, Any]:
    return qwen_demo_config(
        preset,
        dtype,
        architectures=[ARCHITECTURE],
        model_type="qwen2_moe",
        shared_expert_intermediate_size=2 * preset["intermediate_size"],
        qkv_bias=True,
        norm_topk_prob=False,
    )


PLAN_PRESETS = {
    # Qwen/Qwen1.5-MoE-A2.7B: 14.3 B parameters (2.7 B active), 60 experts top-4 + a shared expert
    "qwen1.5-moe-a2.7b": ModelSpec(
        architecture=ARCHITECTURE,
        hidden_size=2048,
        intermediate_size=1408,
        num_layers=24,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        num_experts=60,
        top_k=4,
        vocab_size=151936,
        max_position_embeddings=8192,
        dtype="bfloat16",
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        norm_topk_prob=False,
        qkv_bias=True,
        shared_expert_size=5632,
        bos_token_id=None,
        eos_token_ids=(151643,),
    ),
}

FAMILY = Family(
    name="qwen2-moe",
    architecture=ARCHITECTURE,
    model_type="qwen2_moe",
    read_config=read_config,
    load_layer=load_layer,
    top_names=HF_TOP_NAMES,
    demo_config=demo_config,
    random_weights=random_weights,
    plan_presets=PLAN_PRESETS,
)
