"""Tensor parallelism over gpu_expert ranks: which slice of every weight a rank holds.

Megatron-style, the way vLLM and SGLang split a Mixtral (docs/parallel.md says why each choice):

* attention by heads: rank r holds query heads [r H/N, (r+1) H/N) and the KV heads they read
  (K/N of them, or, when K < N, the one KV head its queries share, replicated on N/K ranks), so its
  rows of the fused QKV (and of its bias) and its columns of o_proj;
* every expert (and a shared expert, and a dense layer's MLP) along the intermediate dimension:
  rank r holds rows [r I/N, (r+1) I/N) of the gate and of the up projection (its w13) and the same
  columns of w2;
* o_proj and w2 leave partial sums: one all-reduce after the attention output, one after the
  experts (shared expert included), per layer;
* the router, the norms and the embedding are replicated (a few MB: splitting them would add a
  collective per layer or per step for nothing); the head lives on rank 0 only, the rank that
  samples.

A rank's part of the model is itself a model (`rank_spec`): fewer heads, a narrower expert; every
stage function runs on it unchanged. The weight store lays each expert out rank by rank
(`arena.py`), so a rank's slice of an expert is one contiguous range and streaming it is one copy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moe_lightning.quant.kernels import QuantizedLinear
from moe_lightning.quant.scheme import MXFP4_BLOCK, QuantFormat
from moe_lightning.spec import ModelSpec
from moe_lightning.weights import ExpertWeights, LayerWeights, Weight


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank `rank` of `world` tensor-parallel ranks."""

    rank: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} of {self.world} ranks")

    @property
    def leads(self) -> bool:
        """Rank 0 talks to the orchestrator and to cpu_attention, and samples."""
        return self.rank == 0


SOLO = Shard()


def query_heads(spec: ModelSpec, shard: Shard) -> range:
    per = spec.num_heads // shard.world
    return range(shard.rank * per, (shard.rank + 1) * per)


def kv_heads(spec: ModelSpec, shard: Shard) -> range:
    """The KV heads rank `shard.rank`'s query heads read (one, replicated, when K < N)."""
    k, n = spec.num_kv_heads, shard.world
    if k >= n:
        return range(shard.rank * k // n, (shard.rank + 1) * k // n)
    first = shard.rank // (n // k)
    return range(first, first + 1)


def kv_owner(spec: ModelSpec, world: int, head: int) -> int:
    """The first rank that holds KV head `head` (whose copy the hand-off carries)."""
    k = spec.num_kv_heads
    return head // (k // world) if k >= world else head * (world // k)


def rank_spec(spec: ModelSpec, shard: Shard) -> ModelSpec:
    """The rank's part of the model, as a model: its heads, its slice of every FFN's width."""
    if shard.world == 1:
        return spec
    n = shard.world
    return dataclasses.replace(
        spec,
        num_heads=spec.num_heads // n,
        num_kv_heads=len(kv_heads(spec, shard)),
        intermediate_size=spec.intermediate_size // n,
        shared_expert_size=spec.shared_expert_size // n,
        dense_intermediate_size=spec.dense_intermediate_size // n,
    )


# --- slicing ---------------------------------------------------------------------------------------
def _head_rows(heads: range, head_dim: int, offset: int = 0) -> slice:
    return slice(offset + heads.start * head_dim, offset + heads.stop * head_dim)


def qkv_rows(spec: ModelSpec, shard: Shard) -> list[slice]:
    """The rank's rows of the fused QKV projection (and of its bias): its q, k and v heads."""
    q, kv = query_heads(spec, shard), kv_heads(spec, shard)
    hd = spec.head_dim
    return [_head_rows(q, hd), _head_rows(kv, hd, spec.q_size), _head_rows(kv, hd, spec.q_size + spec.kv_size)]


def _rows(w: Weight, parts: list[slice]) -> Weight:
    """Rows `parts` of w, concatenated (a copy: the rank's own contiguous weight)."""
    if isinstance(w, torch.Tensor):
        return torch.cat([w[p] for p in parts]).contiguous()
    pieces = [w.rows(p.start, p.stop) for p in parts]
    cat = {
        name: torch.cat([dict(piece.components())[name] for piece in pieces]).contiguous()
        for name, _ in pieces[0].components()
    }
    return QuantizedLinear(w.format, **cat, perm=w.perm)  # perm: one per row block (gate, up), kept whole


def _columns(w: Weight, cols: slice) -> Weight:
    """Input columns `cols` of w (a copy). A quantized weight keeps its per-row scales whole and
    takes the scales of its groups (`check_splittable` made the slice whole groups)."""
    if isinstance(w, torch.Tensor):
        return w[:, cols].contiguous()
    assert w.perm is None, "act order is refused by check_splittable"
    if w.format is QuantFormat.INT8:
        return QuantizedLinear(w.format, w.qweight[:, cols].contiguous(), w.scales.contiguous())
    packed = slice(cols.start // 2, cols.stop // 2)  # two 4-bit values a byte
    if w.format is QuantFormat.MXFP4:  # one e8m0 scale per MXFP4_BLOCK columns
        blocks = slice(cols.start // MXFP4_BLOCK, cols.stop // MXFP4_BLOCK)
        return QuantizedLinear(w.format, w.qweight[:, packed].contiguous(), w.scales[:, blocks].contiguous())
    assert w.zeros is not None
    groups = w.scales.shape[1]
    g = w.in_features // groups
    grp = slice(0, 1) if groups == 1 else slice(cols.start // g, cols.stop // g)
    return QuantizedLinear(
        w.format, w.qweight[:, packed].contiguous(), w.scales[:, grp].contiguous(), w.zeros[:, grp].contiguous()
    )


def ffn_slice(w13: Weight, w2: Weight, width: int, shard: Shard) -> ExpertWeights:
    """Rank `shard`'s slice of an FFN of intermediate width `width`: its gate and up rows, its w2 columns."""
    per = width // shard.world
    mine = slice(shard.rank * per, (shard.rank + 1) * per)
    gate_up = [mine, slice(width + mine.start, width + mine.stop)]
    return ExpertWeights(_rows(w13, gate_up), _columns(w2, mine))


def shard_layer(spec: ModelSpec, layer: LayerWeights, shard: Shard) -> LayerWeights:
    """The rank's dense weights of one layer (copies of its slices; replicated ones as they are).
    Its experts are left as they are: the arena already holds them rank by rank."""
    if shard.world == 1:
        return layer
    rows = qkv_rows(spec, shard)

    def ffn(mlp: ExpertWeights | None, width: int) -> ExpertWeights | None:
        return None if mlp is None else ffn_slice(mlp.w13, mlp.w2, width, shard)

    wqkv = _rows(layer.wqkv, rows)
    assert isinstance(wqkv, torch.Tensor)
    return dataclasses.replace(
        layer,
        wqkv=wqkv,
        wqkv_bias=None if layer.wqkv_bias is None else torch.cat([layer.wqkv_bias[r] for r in rows]),
        wo=layer.wo[:, rows[0]].contiguous(),
        shared=ffn(layer.shared, spec.shared_expert_size),
        mlp=ffn(layer.mlp, spec.dense_intermediate_size),
    )
