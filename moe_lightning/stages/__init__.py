"""The forward pass split into the stages the services run.

Each stage is a plain function of (weights, activations, metadata) with no hidden state, so any
process can run any stage: pre-attention and post-attention on the expert device, attention next to
the KV cache, the head wherever the logits are needed.

Shape comments in the stage functions (and in the modules that call them) use one legend, so that a
comment such as ``(T, H, Hd)`` means the same thing everywhere:

    T    tokens in a ragged batch (every sequence's new tokens, concatenated; no padding)
    B    sequences in the batch
    D    hidden size
    H    query heads
    K    KV heads
    G    query heads per KV head, H / K (GQA: a KV head's G query heads are attended as G queries)
    Hd   head dim (not always D / H)
    E    experts per layer
    A    active experts per token (the router's top-k)
    I    expert intermediate size
    V    vocabulary size
    L    layers
    NB   KV blocks in the paged cache
    BS   tokens per KV block (block size)
"""

from moe_lightning.stages.attend import BatchPlans, attend, plan_batch
from moe_lightning.stages.attention import AttentionMetadata, AttentionPlan, paged_attention, plan_attention, write_kv
from moe_lightning.stages.head import head_logits
from moe_lightning.stages.moe import experts_forward, route
from moe_lightning.stages.post_attention import attention_output, ffn, post_attention
from moe_lightning.stages.pre_attention import embed_tokens, pre_attention

__all__ = [
    "AttentionMetadata",
    "AttentionPlan",
    "BatchPlans",
    "attend",
    "attention_output",
    "embed_tokens",
    "experts_forward",
    "ffn",
    "head_logits",
    "paged_attention",
    "plan_attention",
    "plan_batch",
    "post_attention",
    "pre_attention",
    "route",
    "write_kv",
]
