"""DBRX (DbrxForCausalLM): attention and FFN settings nested in attn_config / ffn_config, a fused
Wqkv (our layout already) with clip_qkv, LayerNorms without bias, every expert of a layer in three
(E * I, D) matrices (w1 gate, v1 up, w2 down stored transposed), top-k weights divided by their L_p
norm. Not loadable from GPTQ (see `gptq_unsupported`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moe_lightning.families import mixtral
from moe_lightning.families.family import Family, Randoms, TopNames
from moe_lightning.hf_configs import ModelSpecError, checkpoint_dtype, eos_ids, require, rope_theta
from moe_lightning.spec import ModelSpec

if TYPE_CHECKING:
    import torch

    from moe_lightning.checkpoint import CheckpointReader
    from moe_lightning.weights import LayerWeights

ARCHITECTURE = "DbrxForCausalLM"
NAMES = TopNames("transformer.wte.weight", "transformer.norm_f.weight")


def read_config(config: dict[str, Any], arch: str) -> dict[str, Any]:
    attn = config.get("attn_config") or {}
    ffn = config.get("ffn_config") or {}
    act = (ffn.get("ffn_act_fn") or {}).get("name", "silu")
    if act != "silu":
        raise ModelSpecError(f"ffn_config.ffn_act_fn = {act!r} is not supported for {arch}; supported: 'silu'")
    hidden = int(require(config, "d_model"))
    heads = int(require(config, "n_heads"))
    norm_p = ffn.get("moe_normalize_expert_weights", 1.0)
    clip = attn.get("clip_qkv")
    return dict(
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=int(require(ffn, "ffn_hidden_size")),
        num_layers=int(require(config, "n_layers")),
        num_heads=heads,
        num_kv_heads=int(attn.get("kv_n_heads") or heads),
        head_dim=hidden // heads if heads else 0,
        num_experts=int(require(ffn, "moe_num_experts")),
        top_k=int(require(ffn, "moe_top_k")),
        vocab_size=int(require(config, "vocab_size")),
        norm_topk_prob=norm_p is not None,
        topk_norm_p=float(norm_p) if norm_p is not None else 1.0,
        # transformers 5 writes a top-level rope_parameters (and uses only that); released DBRX
        # configs carry attn_config.rope_theta (500000), which transformers 5.24 ignores
        rope_theta=rope_theta(config, float(attn.get("rope_theta", 10_000.0))),
        rms_norm_eps=1e-5,  # nn.LayerNorm's default, which DBRX uses
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        dtype=checkpoint_dtype(config),
        max_position_embeddings=int(config.get("max_seq_len", 2048)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos_ids(config.get("eos_token_id")),
        clip_qkv=None if clip is None else float(clip),
        norm="layer",
    )


def load_layer(
    reader: CheckpointReader, spec: ModelSpec, i: int, dtype: torch.dtype, device: torch.device | str
) -> LayerWeights:
    import torch

    from moe_lightning.families.hf_layout import to_layout
    from moe_lightning.weights import ExpertWeights, LayerWeights

    d, e, inter = spec.hidden_size, spec.num_experts, spec.intermediate_size
    p = f"transformer.blocks.{i}"
    a = f"{p}.norm_attn_norm"

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return to_layout(reader.get(name, shape), dtype, device)

    w1 = reader.get(f"{p}.ffn.experts.mlp.w1", (e * inter, d)).view(e, inter, d)
    v1 = reader.get(f"{p}.ffn.experts.mlp.v1", (e * inter, d)).view(e, inter, d)
    w2 = reader.get(f"{p}.ffn.experts.mlp.w2", (e * inter, d)).view(e, inter, d)
    experts = [
        ExpertWeights(to_layout(torch.cat([w1[j], v1[j]], dim=0), dtype, device), to_layout(w2[j].T, dtype, device))
        for j in range(e)
    ]
    return LayerWeights(
        attn_norm=get(f"{a}.norm_1.weight", (d,)),
        wqkv=get(f"{a}.attn.Wqkv.weight", (spec.q_size + 2 * spec.kv_size, d)),
        wo=get(f"{a}.attn.out_proj.weight", (d, spec.q_size)),
        ffn_norm=get(f"{a}.norm_2.weight", (d,)),
        router=get(f"{p}.ffn.router.layer.weight", (e, d)),
        experts=experts,
    )


def random_weights(spec: ModelSpec, rand: Randoms, progress: bool) -> dict[str, torch.Tensor]:
    from tqdm import tqdm

    d, inter, e = spec.hidden_size, spec.intermediate_size, spec.num_experts
    normal, norm = rand.normal, rand.norm
    sd: dict[str, torch.Tensor] = {NAMES.embed: normal(spec.vocab_size, d)}
    for i in tqdm(range(spec.num_layers), desc="generating layers", unit="layer", disable=not progress, leave=False):
        p = f"transformer.blocks.{i}"
        a = f"{p}.norm_attn_norm"
        sd[f"{a}.norm_1.weight"] = norm(d)
        sd[f"{a}.attn.Wqkv.weight"] = normal(spec.q_size + 2 * spec.kv_size, d)
        sd[f"{a}.attn.out_proj.weight"] = normal(d, spec.q_size)
        sd[f"{a}.norm_2.weight"] = norm(d)
        sd[f"{p}.ffn.router.layer.weight"] = normal(e, d)
        for w in ("w1", "v1", "w2"):
            sd[f"{p}.ffn.experts.mlp.{w}"] = normal(e * inter, d)
    sd[NAMES.final_norm] = norm(d)
    sd[NAMES.lm_head] = normal(spec.vocab_size, d)
    return sd


def demo_config(preset: dict[str, Any], dtype: str) -> dict[str, Any]:
    config = mixtral.demo_config(preset, dtype)
    theta = 500_000.0
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "dbrx",
        "d_model": config["hidden_size"],
        "n_heads": config["num_attention_heads"],
        "n_layers": config["num_hidden_layers"],
        "max_seq_len": config["max_position_embeddings"],
        "vocab_size": config["vocab_size"],
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": dtype,
        # both spellings, equal: transformers 5 reads rope_parameters, released configs attn_config
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attn_config": {"kv_n_heads": config["num_key_value_heads"], "clip_qkv": 8.0, "rope_theta": theta},
        "ffn_config": {
            "ffn_hidden_size": config["intermediate_size"],
            "moe_num_experts": config["num_local_experts"],
            "moe_top_k": config["num_experts_per_tok"],
            "moe_normalize_expert_weights": 1.0,
            "ffn_act_fn": {"name": "silu"},
        },
    }


PLAN_PRESETS = {
    # databricks/dbrx-base: 132 B parameters, 16 experts top-4, fine-grained experts
    "dbrx": ModelSpec(
        architecture=ARCHITECTURE,
        hidden_size=6144,
        intermediate_size=10752,
        num_layers=40,
        num_heads=48,
        num_kv_heads=8,
        head_dim=128,
        num_experts=16,
        top_k=4,
        vocab_size=100352,
        max_position_embeddings=32768,
        dtype="bfloat16",
        rope_theta=500000.0,
        eos_token_ids=(100257,),
        bos_token_id=None,
    ),
}

FAMILY = Family(
    name="dbrx",
    architecture=ARCHITECTURE,
    model_type="dbrx",
    read_config=read_config,
    load_layer=load_layer,
    top_names=NAMES,
    demo_config=demo_config,
    random_weights=random_weights,
    plan_presets=PLAN_PRESETS,
    gptq_unsupported=(
        "DBRX stores each layer's experts as one fused parameter, not as the per-expert Linear layers GPTQ quantizes"
    ),
)
