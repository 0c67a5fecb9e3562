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


def _tensors_of(*weights: Weight | None) -> Iterator[torch.Tensor]:
    """The tensors behind `weights` (a quantized one's parts), skipping the absent."""
    for w in weights:
        if isinstance(w, torch.Tensor):
            yield w
        elif w is not None:
            yield from w.tensors()


@dataclass(slots=True)
class ExpertWeights:
    w13: Weight  # (2I, D): gate rows [0, I), up rows [I, 2I)
    w2: Weight  # (D, I)
    b13: torch.Tensor | None = None  # (2I,) gate/up bias, in w13's row order (GPT-OSS)
    b2: torch.Tensor | None = None  # (D,) down bias

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from _tensors_of(self.w13, self.b13, self.w2, self.b2)

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

        b13, b2 = (None if b is None else moved(b) for b in (self.b13, self.b2))
        return ExpertWeights(weight(self.w13), weight(self.w2), b13, b2)

    def to(self, device: torch.device | str) -> ExpertWeights:
        """A copy on `device`: one transfer of the page when there is one, else part by part."""
        try:
            page = self.page()
        except ValueError:
            b13, b2 = (None if b is None else b.to(device) for b in (self.b13, self.b2))
            return ExpertWeights(self.w13.to(device), self.w2.to(device), b13, b2)
        return self.in_buffer(page.to(device))


@dataclass(frozen=True, slots=True)
class MlaWeights:
    """A layer's MLA projections (stages/mla.py; its shape letters Cq, C, N, R, Dv); o_proj is the layer's `wo`.
    kv_b_proj is kept split per head into its key and value rows, the absorbed projections' operands."""

    kv_a_proj_with_mqa: torch.Tensor  # (C + R, D): compressed KV rows [0, C), the shared rope key [C, C + R)
    kv_a_layernorm: torch.Tensor  # (C,)
    w_uk: torch.Tensor  # (H, N, C): kv_b_proj's key rows, per head (`split_kv_b_proj`)
    w_uv: torch.Tensor  # (H, Dv, C): kv_b_proj's value rows, per head
    q_a_proj: torch.Tensor | None = None  # (Cq, D)
    q_a_layernorm: torch.Tensor | None = None  # (Cq,)
    q_b_proj: torch.Tensor | None = None  # (H * (N + R), Cq): per head, nope rows then rope rows
    q_proj: torch.Tensor | None = None  # (H * (N + R), D), in place of the three above when Cq is None

    def __post_init__(self) -> None:
        lora = (self.q_a_proj, self.q_a_layernorm, self.q_b_proj)
        if self.q_proj is None and any(t is None for t in lora):
            raise ValueError("MLA needs q_proj, or all of q_a_proj, q_a_layernorm and q_b_proj")
        if self.q_proj is not None and any(t is not None for t in lora):
            raise ValueError("MLA takes q_proj or the q LoRA (q_a_proj, q_a_layernorm, q_b_proj), not both")

    def named(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(field, tensor) of every tensor it holds."""
        for name in ("kv_a_proj_with_mqa", "kv_a_layernorm", "w_uk", "w_uv", "q_a_proj", "q_a_layernorm", "q_b_proj"):
            t = getattr(self, name)
            if t is not None:
                yield name, t
        if self.q_proj is not None:
            yield "q_proj", self.q_proj

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from (t for _, t in self.named())


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # (D,)
    wqkv: Weight | None  # ((H + 2K) * Hd, D); None with MLA; quantized with --quantize-dense (quant/dense.py)
    wo: Weight  # (D, H * Hd)
    ffn_norm: torch.Tensor  # (D,)
    router: torch.Tensor | None  # (E, D); None in a dense layer
    experts: Sequence[ExpertWeights]  # E entries; none in a dense layer
    q_norm: torch.Tensor | None = None  # (H * Hd,) over the projection (OLMoE) or (Hd,) per head (Qwen3)
    k_norm: torch.Tensor | None = None  # (K * Hd,) or (Hd,)
    wqkv_bias: torch.Tensor | None = None  # ((H + 2K) * Hd,) (Qwen2-MoE)
    shared: ExpertWeights | None = None  # an always-on expert (2Is, D) / (D, Is) (Qwen2-MoE)
    shared_gate: torch.Tensor | None = None  # (1, D): sigmoid gate of the shared expert (Qwen2-MoE)
    mlp: ExpertWeights | None = None  # a dense layer's FFN (2Id, D) / (D, Id), in place of router + experts
    # (E,): the sigmoid router's selection bias, fp32 (DeepSeek-V3, GLM-4.5); the router's bias (GPT-OSS)
    router_bias: torch.Tensor | None = None
    mla: MlaWeights | None = None  # MLA's projections, in place of wqkv (DeepSeek-V3)
    wo_bias: torch.Tensor | None = None  # (D,) (GPT-OSS)
    sinks: torch.Tensor | None = None  # (H,) each head's sink logit (GPT-OSS)

    def dense_tensors(self) -> Iterator[torch.Tensor]:
        yield from _tensors_of(self.attn_norm, self.wqkv, self.wo, self.ffn_norm)
        if self.mla is not None:
            yield from self.mla.tensors()
        optional = (
            self.router,
            self.router_bias,
            self.q_norm,
            self.k_norm,
            self.wqkv_bias,
            self.shared_gate,
            self.wo_bias,
            self.sinks,
        )
        yield from (t for t in optional if t is not None)
        for mlp in (self.shared, self.mlp):
            if mlp is not None:
                yield from mlp.tensors()


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor  # (V, D)
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # (D,)
    lm_head: Weight  # (V, D); the same storage as embed when embeddings are tied; quantized as wqkv may be

    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        tensors = list(_tensors_of(self.embed, self.final_norm, self.lm_head))
        for layer in self.layers:
            tensors.extend(layer.dense_tensors())
            for expert in layer.experts:
                tensors.extend(expert.tensors())
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total
