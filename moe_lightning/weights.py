"""Our in-memory weight layout, shared by every stage function.

Layout choices (why, not what): q/k/v are fused into one matrix so pre-attention is one GEMM; an
expert's gate and up projections are fused (w13) so an expert costs two GEMMs, and each expert is
its own object so it can be a page that is resident, streamed, or computed elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from moe_lightning.quant.kernels import QuantizedLinear

Weight = torch.Tensor | QuantizedLinear  # an expert's weight: the model's dtype, or a quantized page


@dataclass(slots=True)
class ExpertWeights:
    w13: Weight  # (2I, D): gate rows [0, I), up rows [I, 2I)
    w2: Weight  # (D, I)

    def tensors(self) -> Iterator[torch.Tensor]:
        for w in (self.w13, self.w2):
            if isinstance(w, torch.Tensor):
                yield w
            else:
                yield from w.tensors()

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def page(self) -> torch.Tensor:
        """The bytes of the one contiguous range every part of this expert lives in (an arena page),
        as a uint8 tensor over the same storage: copying it moves the whole expert at once."""
        parts = list(self.tensors())
        storage = parts[0].untyped_storage()
        if any(t.untyped_storage().data_ptr() != storage.data_ptr() or not t.is_contiguous() for t in parts):
            raise ValueError("an expert page needs all its parts contiguous in one storage (an arena view)")
        start = min(t.data_ptr() for t in parts)
        end = max(t.data_ptr() + t.numel() * t.element_size() for t in parts)
        out = torch.empty(0, dtype=torch.uint8, device=parts[0].device)
        return out.set_(storage, start - storage.data_ptr(), (end - start,))

    def in_buffer(self, buffer: torch.Tensor) -> ExpertWeights:
        """The same parts at the same offsets inside `buffer` (uint8, the size of `page()`): how a
        device slot holding a copy of this page, or of any expert laid out alike, is read."""
        base = self.page().data_ptr()

        def moved(t: torch.Tensor) -> torch.Tensor:
            off = t.data_ptr() - base
            return buffer[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)

        def weight(w: Weight) -> Weight:
            if isinstance(w, torch.Tensor):
                return moved(w)
            return QuantizedLinear(w.format, **{name: moved(t) for name, t in w.components()})

        return ExpertWeights(weight(self.w13), weight(self.w2))

    def to(self, device: torch.device | str) -> ExpertWeights:
        """A copy on `device`: one transfer of the page when there is one, else part by part."""
        try:
            page = self.page()
        except ValueError:
            return ExpertWeights(self.w13.to(device), self.w2.to(device))
        return self.in_buffer(page.to(device))


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
