"""One layer's attention over the paged cache for any attention kind: the new tokens' keys and values
written, then attended. The three places attention runs (cpu_attention's worker, gpu_expert's device
attention, the in-process engine) call this, so a kind is added in one place."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_lightning.kv_layout import KVLayout
from moe_lightning.spec import ModelSpec
from moe_lightning.stages.attention import (
    AttentionMetadata,
    AttentionPlan,
    Int8KV,
    KVCache,
    paged_attention,
    plan_attention,
    write_kv,
)
from moe_lightning.stages.mla import mla_paged_attention, mla_shape, write_latent


@dataclass(frozen=True, slots=True)
class BatchPlans:
    """A batch's attention plans, one per layer group of the cache (kv_layout.py: GPT-OSS alternates a
    sliding window, whose layers keep blocks of their own, with the whole context), built once per
    batch and shared by the group's layers."""

    meta: AttentionMetadata
    by_group: tuple[AttentionPlan, ...]  # (G,) each group's, over its block tables and within its window
    layer_group: tuple[int, ...]  # (L,) each layer's group

    def __getitem__(self, layer: int) -> AttentionPlan:
        return self.by_group[self.layer_group[layer]]


def plan_batch(spec: ModelSpec, meta: AttentionMetadata, device: torch.device | str = "cpu") -> BatchPlans:
    layout = KVLayout.of(spec, meta.block_size)
    if meta.num_groups != layout.num_groups:
        raise ValueError(
            f"the batch has {meta.num_groups} layer groups' block tables; the model's layers need {layout.num_groups}"
        )
    plans = tuple(plan_attention(meta.group(g), w, device) for g, w in enumerate(layout.windows))
    return BatchPlans(meta, plans, layout.layer_group)


def attend(
    spec: ModelSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: KVCache,
    v_cache: KVCache,
    plan: AttentionPlan,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: (T, H, Hd), k/v: (T, K, Hd) from pre_attention; k_cache/v_cache: one layer's (NB, BS, K, Hd)
    (PagedKVCache.layer); `plan`: the layer's (BatchPlans[layer]); `sinks`: the layer's (H,) sink logits (GPT-OSS)
    -> (T, H * Hd) in q's dtype; with MLA (K = 1, Hd = C + R, k the latent row, V the cache's K)
    -> (T, H * C), the attended latents for attention_output."""
    if spec.attention == "mla":
        if isinstance(k_cache, Int8KV):  # quantized per row as write_kv stores it (V is the same cache)
            write_kv(k_cache, k_cache, k, k, plan.write_slots)
        else:
            write_latent(k_cache, k[:, 0], plan.write_slots)
        shape = mla_shape(spec)
        out = mla_paged_attention(q, k_cache, plan, shape.softmax_scale, shape.kv_lora_rank)  # (T, H, C)
        return out.reshape(q.shape[0], -1)
    write_kv(k_cache, v_cache, k, v, plan.write_slots)
    return paged_attention(q, k_cache, v_cache, plan, sinks)
