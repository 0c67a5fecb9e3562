"""Shapes of the models the paper evaluates, and of the other supported families, for planning
without a checkpoint (bf16)."""

from __future__ import annotations

from moe_lightning.spec import ModelSpec

ARCHS: dict[str, ModelSpec] = {
    # mistralai/Mixtral-8x7B-v0.1: 46.7 B parameters
    "mixtral-8x7b": ModelSpec(
        architecture="MixtralForCausalLM",
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
        architecture="MixtralForCausalLM",
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
    # databricks/dbrx-base: 132 B parameters, 16 experts top-4, fine-grained experts
    "dbrx": ModelSpec(
        architecture="DbrxForCausalLM",
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
    # allenai/OLMoE-1B-7B-0924: 6.9 B parameters (1.3 B active), 64 experts top-8
    "olmoe-1b-7b": ModelSpec(
        architecture="OlmoeForCausalLM",
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
    # Qwen/Qwen3-30B-A3B: 30.5 B parameters (3.3 B active), 128 experts top-8
    "qwen3-30b-a3b": ModelSpec(
        architecture="Qwen3MoeForCausalLM",
        hidden_size=2048,
        intermediate_size=768,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        num_experts=128,
        top_k=8,
        vocab_size=151936,
        max_position_embeddings=40960,
        dtype="bfloat16",
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        qk_norm="head",
        bos_token_id=None,
        eos_token_ids=(151645,),
    ),
}
