"""DeepSeek-V3 / R1 (DeepseekV3ForCausalLM): MLA attention over a latent KV cache (stages/mla.py,
docs/architecture.md "MLA"), q LoRA, decoupled RoPE with interleaved pairs and YaRN; the sigmoid
router with a selection bias among expert groups (GLM-4.5's, stages/grouped_routing.py), shared
experts without a gate, leading dense layers (first_k_dense_replace). Released checkpoints carry a
multi-token-prediction layer past the last decoder layer: not loaded (the log names it)."""

from __future__ import annotations

from typing import Any

from moe_lightning.families import mixtral
from moe_lightning.families.family import HF_TOP_NAMES, SHARED_EXPERTS_NAMES, Family, hf_layout_family
from moe_lightning.hf_configs import ModelSpecError, checkpoint_dtype, eos_ids, require, rope_theta, yarn_scaling
from moe_lightning.spec import ModelSpec
from moe_lightning.yarn import YarnScaling

ARCHITECTURE = "DeepseekV3ForCausalLM"


def read_config(config: dict[str, Any], arch: str) -> dict[str, Any]:
    if config.get("attention_bias"):
        raise ModelSpecError(f"attention_bias = true is not supported for {arch}")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ModelSpecError(f"hidden_act = {act!r} is not supported for {arch}; supported: 'silu'")
    layers = int(require(config, "num_hidden_layers"))
    first_dense = int(config.get("first_k_dense_replace", 0))
    if not 0 <= first_dense < layers:
        raise ModelSpecError(f"first_k_dense_replace must be in 0..{layers - 1}, got {first_dense}")
    c, r = int(require(config, "kv_lora_rank")), int(require(config, "qk_rope_head_dim"))
    q_lora = config.get("q_lora_rank")
    moe_width = int(require(config, "moe_intermediate_size"))
    return dict(
        architecture=arch,
        hidden_size=int(require(config, "hidden_size")),
        intermediate_size=moe_width,
        num_layers=layers,
        num_heads=int(require(config, "num_attention_heads")),
        num_kv_heads=1,  # the latent row, one "KV head" of C + R dims
        head_dim=c + r,
        num_experts=int(require(config, "n_routed_experts")),
        top_k=int(require(config, "num_experts_per_tok")),
        vocab_size=int(require(config, "vocab_size")),
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        rope_theta=rope_theta(config, 10_000.0, ("default", "yarn")),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        dtype=checkpoint_dtype(config),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos_ids(config.get("eos_token_id")),
        dense_layers=tuple(range(first_dense)),
        dense_intermediate_size=int(require(config, "intermediate_size")) if first_dense else 0,
        shared_expert_size=int(config.get("n_shared_experts") or 0) * moe_width,
        shared_expert_gate=False,
        router_score="sigmoid",
        n_group=int(config.get("n_group") or 1),
        topk_group=int(config.get("topk_group") or 1),
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        rope_interleave=bool(config.get("rope_interleave", True)),
        yarn=yarn_scaling(config),
        attention="mla",
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=c,
        qk_nope_head_dim=int(require(config, "qk_nope_head_dim")),
        qk_rope_head_dim=r,
        v_head_dim=int(require(config, "v_head_dim")),
    )


load_layer, random_weights = hf_layout_family((SHARED_EXPERTS_NAMES,))


def demo_config(preset: dict[str, Any], dtype: str) -> dict[str, Any]:
    """A DeepSeek-V3 config.json with a preset's shapes: MLA with q LoRA (ranks of half the hidden
    size), its first layer dense, one shared expert, two expert groups of which the best is kept, and
    YaRN over a quarter of the context (so positions past it are scaled)."""
    config = mixtral.demo_config(preset, dtype)
    experts, d = config.pop("num_local_experts"), config["hidden_size"]
    heads = config["num_attention_heads"]
    for name in ("sliding_window", "rope_theta", "num_key_value_heads"):
        config.pop(name, None)
    head = d // heads
    config.update(
        architectures=[ARCHITECTURE],
        model_type="deepseek_v3",
        n_routed_experts=experts,
        n_shared_experts=1,
        moe_intermediate_size=config["intermediate_size"],
        intermediate_size=4 * d,  # the dense layer's MLP width
        first_k_dense_replace=1 if config["num_hidden_layers"] > 1 else 0,
        n_group=2 if experts % 2 == 0 and experts >= 2 * config["num_experts_per_tok"] else 1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        q_lora_rank=d // 2,
        kv_lora_rank=d // 2,
        qk_nope_head_dim=head,
        qk_rope_head_dim=max(2, head // 2),
        v_head_dim=head,
        num_key_value_heads=heads,
        rope_interleave=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10_000.0,
            "factor": 4.0,
            "original_max_position_embeddings": max(1, config["max_position_embeddings"] // 4),
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        num_nextn_predict_layers=0,
        rms_norm_eps=1e-6,
    )
    return config


PLAN_PRESETS = {
    # deepseek-ai/DeepSeek-V3 (and R1): 671 B parameters (37 B active), 256 experts top-8 in 8 groups (4 kept)
    # + a shared one, 3 dense layers, MLA caching 512 + 64 values per token and layer
    "deepseek-v3": ModelSpec(
        architecture=ARCHITECTURE,
        hidden_size=7168,
        intermediate_size=2048,
        num_layers=61,
        num_heads=128,
        num_kv_heads=1,
        head_dim=576,
        num_experts=256,
        top_k=8,
        vocab_size=129280,
        max_position_embeddings=163840,
        dtype="bfloat16",
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_ids=(1,),
        dense_layers=(0, 1, 2),
        dense_intermediate_size=18432,
        shared_expert_size=2048,
        shared_expert_gate=False,
        router_score="sigmoid",
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        rope_interleave=True,
        yarn=YarnScaling(40.0, 4096, 32.0, 1.0, 1.0, 1.0),
        attention="mla",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
}

FAMILY = Family(
    name="deepseek-v3",
    architecture=ARCHITECTURE,
    model_type="deepseek_v3",
    read_config=read_config,
    load_layer=load_layer,
    top_names=HF_TOP_NAMES,
    demo_config=demo_config,
    random_weights=random_weights,
    plan_presets=PLAN_PRESETS,
)
