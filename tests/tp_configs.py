"""Small models of the families tensor parallelism is tested on, each splittable over 2 and 3 ranks:
6 query heads; KV heads split (6) or replicated on every rank (1); every FFN width a multiple of 6."""

from __future__ import annotations

from typing import Any

ROPE = {"rope_type": "default", "rope_theta": 10000.0}

TP_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": (
        "mixtral",
        dict(
            vocab_size=320,
            hidden_size=96,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=6,
            num_local_experts=6,
            num_experts_per_tok=2,
            max_position_embeddings=512,
        ),
    ),
    "qwen2_moe_shared_dense": (  # QKV bias, a shared expert with its gate, one KV head, layer 1 dense
        "qwen2_moe",
        dict(
            vocab_size=256,
            hidden_size=96,
            intermediate_size=96,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=24,
            mlp_only_layers=[1],
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=1,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            max_position_embeddings=512,
            rope_parameters=ROPE,
            eos_token_id=None,
            bos_token_id=1,
        ),
    ),
    "dbrx": (  # fused Wqkv clipped, LayerNorm
        "dbrx",
        dict(
            vocab_size=256,
            d_model=96,
            n_layers=2,
            n_heads=6,
            max_seq_len=512,
            eos_token_id=None,
            bos_token_id=1,
            attn_config={"kv_n_heads": 6, "clip_qkv": 0.08, "rope_theta": 10000},
            ffn_config={"ffn_hidden_size": 48, "moe_num_experts": 8, "moe_top_k": 2},
        ),
    ),
}


def rank_device_budget(model: Any, world: int, ring: int, resident_per_layer: int = 0) -> int:
    """A per-device --device-memory with which rank 0 (the one with the head: the most dense bytes)
    holds its dense slices, `resident_per_layer` expert slices of every sparse layer and `ring`
    buffer slots (fp32); the other ranks have that much room too, and a little over."""
    import torch

    from moe_lightning.arena import ArenaLayout, weights_from_arena
    from moe_lightning.spec import ModelSpec
    from moe_lightning.tensor_parallel import Shard

    spec = ModelSpec.from_pretrained(model)
    layout = ArenaLayout.for_spec(spec, "float32", ranks=world)
    weights = weights_from_arena(
        torch.zeros(layout.total_bytes, dtype=torch.uint8), layout, spec, shard=Shard(0, world)
    )
    first = spec.experts_per_layer.index(spec.num_experts)
    expert = layout.expert_page_bytes(first, 0, 0)
    dense = weights.nbytes() - spec.total_experts * expert
    return dense + (spec.num_sparse_layers * resident_per_layer + ring) * expert
