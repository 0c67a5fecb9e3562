"""Our in-memory weight layout, shared by every stage function.

Layout choices (why, not what): q/k/v are fused into one matrix so pre-attention is one GEMM; an
expert's gate and up projections are fused (w13) so an expert costs two GEMMs, and each expert is
its own object so it can be a page that is resident, streamed, or computed elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moe_lightning.quant.linear import QuantizedLinear


@dataclass(slots=True)
class ExpertWeights:
    w13: torch.Tensor | QuantizedLinear  # (2I, D): gate rows [0, I), up rows [I, 2I)
    w2: torch.Tensor | QuantizedLinear  # (D, I); quantized only in an expert (quant/)

    def tensors(self) -> Iterator[torch.Tensor]:
        for w in (self.w13, self.w2):
            if isinstance(w, torch.Tensor):
                yield w
            else:  # a quantized page is several tensors (qweight, scales, ...)
                yield from w.tensors()


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # (D,)
    wqkv: torch.Tensor  # ((H + 2K) * Hd, D)
    wo: torch.Tensor  # (D, H * Hd)
    ffn_norm: torch.Tensor  # (D,)
    router: torch.Tensor | None  # (E, D); None in a dense layer
    experts: Sequence[ExpertWeights]  # E entries; none in a dense layer
    q_norm: torch.Tensor | None = None  # (H * Hd,) over the projection (OLMoE) or (Hd,) per head (Qwen3)
    k_norm: torch.Tensor | None = None  # (K * Hd,) or (Hd,)
    wqkv_bias: torch.Tensor | None = None  # ((H + 2K) * Hd,) (Qwen2-MoE)
    shared: ExpertWeights | None = None  # an always-on expert (2Is, D) / (D, Is) (Qwen2-MoE)
    shared_gate: torch.Tensor | None = None  # (1, D): sigmoid gate of the shared expert
    mlp: ExpertWeights | None = None  # a dense layer's FFN (2Id, D) / (D, Id), in place of router + experts

    def dense_tensors(self) -> Iterator[torch.Tensor]:
        yield from (self.attn_norm, self.wqkv, self.wo, self.ffn_norm)
        optional = (self.router, self.q_norm, self.k_norm, self.wqkv_bias, self.shared_gate)
        yield from (t for t in optional if t is not None)
        for mlp in (self.shared, self.mlp):
            if mlp is not None:
                yield from mlp.tensors()


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor  # (V, D)
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # (D,)
    lm_head: torch.Tensor  # (V, D); the same storage as embed when embeddings are tied

    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        tensors = [self.embed, self.final_norm, self.lm_head]
        for layer in self.layers:
            tensors.extend(layer.dense_tensors())
            for expert in layer.experts:
                tensors.extend(expert.tensors())
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total
