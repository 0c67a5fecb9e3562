"""GLM-4.5 / GLM-4.5-Air (Glm4MoeForCausalLM): DeepSeek-V3's routing (sigmoid scores, a selection
bias, expert groups, a scaling factor) and its shared experts without a gate, its leading dense
layers (first_k_dense_replace), with GQA attention: q/k/v biases, optional per-head q/k RMSNorm
(use_qk_norm) and RoPE over the leading half of each head (partial_rotary_factor). Released
checkpoints carry multi-token-prediction layers after the last decoder layer: not loaded."""

from __future__ import annotations

from typing import Any

from moe_lightning.families import mixtral
from moe_lightning.families.family import HF_TOP_NAMES, SHARED_EXPERTS_NAMES, Family, hf_layout_family
from moe_lightning.hf_configs import ModelSpecError, common_fields, eos_ids, require
from moe_lightning.spec import ModelSpec

ARCHITECTURE = "Glm4MoeForCausalLM"


def read_config(config: dict[str, Any], arch: str) -> dict[str, Any]:
    fields = common_fields(config, arch, 10_000.0, 1e-5, attention_bias=True)
    layers = fields["num_layers"]
    first_dense = int(config.get("first_k_dense_replace", 1))
    if not 0 <= first_dense < layers:
        raise ModelSpecError(f"first_k_dense_replace must be in 0..{layers - 1}, got {first_dense}")
    params = config.get("rope_parameters") or {}
    # transformers 5 writes it in rope_parameters, released configs at the top level
    factor = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.5)))
    rotary_dim = int(fields["head_dim"] * factor)
    shared = int(config.get("n_shared_experts") or 0)
    return dict(
        fields,
        intermediate_size=int(require(config, "moe_intermediate_size")),
        num_experts=int(require(config, "n_routed_experts")),
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        eos_token_ids=eos_ids(config.get("eos_token_id")),
        qkv_bias=bool(config.get("attention_bias", False)),
        qk_norm="head" if config.get("use_qk_norm") else None,
        rotary_dim=None if rotary_dim == fields["head_dim"] else rotary_dim,
        dense_layers=tuple(range(first_dense)),
        dense_intermediate_size=int(require(config, "intermediate_size")) if first_dense else 0,
        shared_expert_size=shared * int(require(config, "moe_intermediate_size")),
        shared_expert_gate=False,
        router_score="sigmoid",
        n_group=int(config.get("n_group") or 1),
        topk_group=int(config.get("topk_group") or 1),
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
    )


load_layer, random_weights = hf_layout_family((SHARED_EXPERTS_NAMES,))


def demo_config(preset: dict[str, Any], dtype: str) -> dict[str, Any]:
    """A GLM-4.5 config.json with a preset's shapes: its first layer dense, one shared expert, two
    expert groups of which the best one is kept (so group selection decides), QK-norm on."""
    config = mixtral.demo_config(preset, dtype)
    experts = config.pop("num_local_experts")
    for name in ("sliding_window", "rope_theta"):
        config.pop(name, None)
    config.update(
        architectures=[ARCHITECTURE],
        model_type="glm4_moe",
        n_routed_experts=experts,
        n_shared_experts=1,
        moe_intermediate_size=config["intermediate_size"],
        intermediate_size=4 * config["hidden_size"],  # the dense layer's MLP width
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        first_k_dense_replace=1 if config["num_hidden_layers"] > 1 else 0,
        n_group=2 if experts % 2 == 0 and experts >= 2 * config["num_experts_per_tok"] else 1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        attention_bias=True,
        use_qk_norm=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
        num_nextn_predict_layers=0,
    )
    return config


def _glm(**shape: Any) -> ModelSpec:
    """A published GLM-4.5: what they share, and `shape`."""
    common = dict(
        architecture=ARCHITECTURE,
        head_dim=128,
        num_kv_heads=8,
        num_heads=96,
        vocab_size=151552,
        max_position_embeddings=131072,
        dtype="bfloat16",
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-5,
        rotary_dim=64,
        qkv_bias=True,
        top_k=8,
        shared_expert_gate=False,
        router_score="sigmoid",
        routed_scaling_factor=2.5,
        bos_token_id=None,
        eos_token_ids=(151329, 151336, 151338),
    )
    return ModelSpec(**(common | shape))


PLAN_PRESETS = {
    # zai-org/GLM-4.5-Air: 106 B parameters (12 B active), 128 experts top-8 + a shared one, 1 dense layer
    "glm-4.5-air": _glm(
        hidden_size=4096,
        intermediate_size=1408,
        num_layers=46,
        num_experts=128,
        shared_expert_size=1408,
        dense_layers=(0,),
        dense_intermediate_size=10944,
        routed_scaling_factor=1.0,
    ),
    # zai-org/GLM-4.5: 355 B parameters (32 B active), 160 experts top-8 + a shared one, 3 dense layers
    "glm-4.5": _glm(
        hidden_size=5120,
        intermediate_size=1536,
        num_layers=92,
        num_experts=160,
        shared_expert_size=1536,
        dense_layers=(0, 1, 2),
        dense_intermediate_size=12288,
        qk_norm="head",
    ),
}

FAMILY = Family(
    name="glm4-moe",
    architecture=ARCHITECTURE,
    model_type="glm4_moe",
    read_config=read_config,
    load_layer=load_layer,
    top_names=HF_TOP_NAMES,
    demo_config=demo_config,
    random_weights=random_weights,
    plan_presets=PLAN_PRESETS,
)
