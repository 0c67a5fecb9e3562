"""The per-layer hand-off protocol between the expert service and the attention service.

Expert -> attention, one message per (step, layer, micro-batch): meta {"s": step, "l": layer,
"m": micro-batch} plus, at layer 0 only, {"seqs": ids, "q": new tokens per sequence, "p": cached
tokens per sequence before this step}; tensors q (T, H, Hd), k (T, K, Hd), v (T, K, Hd).
Attention -> expert: the same {"s", "l", "m"} and one tensor (T, H * Hd), or "error" and "code"
(a gRPC status name) and no tensor.
"""

from __future__ import annotations

from moe_lightning.spec import ModelSpec

BYTES_PER_ELEMENT = 4  # hand-offs are fp32 on the CPU path; bf16/fp16 fit in the same slots


def handoff_slot_bytes(spec: ModelSpec, max_tokens: int, kind: str) -> int:
    """Slot size for one message of up to `max_tokens` tokens; kind is "qkv" or "attn"."""
    align = 3 * 64  # up to three tensors, each 64-byte aligned
    if kind == "qkv":
        per_token = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    elif kind == "attn":
        per_token = spec.num_heads * spec.head_dim
    else:
        raise ValueError(f"kind must be 'qkv' or 'attn', got {kind!r}")
    return max_tokens * per_token * BYTES_PER_ELEMENT + align
