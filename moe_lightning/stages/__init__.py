"""The forward pass split into the stages the services run.

Each stage is a plain function of (weights, activations, metadata) with no hidden state, so any
process can run any stage: pre-attention and post-attention on the expert device, attention next to
the KV cache, the head wherever the logits are needed.
"""

from moe_lightning.stages.attention import AttentionMetadata, AttentionPlan, paged_attention, plan_attention, write_kv
from moe_lightning.stages.head import head_logits
from moe_lightning.stages.moe import experts_forward, route
from moe_lightning.stages.post_attention import post_attention
from moe_lightning.stages.pre_attention import embed_tokens, pre_attention

__all__ = [
    "AttentionMetadata",
    "AttentionPlan",
    "embed_tokens",
    "experts_forward",
    "head_logits",
    "paged_attention",
    "plan_attention",
    "post_attention",
    "pre_attention",
    "route",
    "write_kv",
]
