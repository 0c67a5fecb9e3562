"""The paged weight arena: every weight of our layout is a page in one region, 4 KiB aligned.

One expert is one contiguous range (its w13 and w2 and, when quantized, their scales and zeros, 64 B
apart), so streaming an expert is one transfer. For N tensor-parallel ranks each expert is N such
ranges, `layers.L.experts.E.rankR.w13` ..., one per rank's slice (moe_lightning/tensor_parallel.py),
so a rank streams its slice in one transfer too. The expert format (docs/quantization.md) shows in
the pages themselves: `layers.L.experts.E.w13` in the model's dtype, or `...w13.qweight`,
`...w13.scales`, ... The weight store fills the arena (from the checkpoint or its on-disk converted
copy); every other process maps it and builds `ModelWeights` as views, so the weights exist once in
host memory.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

# the layout lives in arena_layout.py (no torch); most users import it from here
from moe_lightning.arena_layout import (  # noqa: F401
    ITEMSIZE,
    LAYOUT_VERSION,
    PAGE_ALIGN,
    ArenaLayout,
    Page,
    expert_page_names,
    expert_prefix,
    mla_shapes,
    page_shapes,
)
from moe_lightning.checkpoint import CheckpointReader, load_layer, skip_extra_layers, top_names
from moe_lightning.quant.kernels import QuantizedLinear
from moe_lightning.quant.rtn import quantize
from moe_lightning.quant.scheme import QuantFormat, QuantScheme
from moe_lightning.spec import ModelSpec
from moe_lightning.tensor_parallel import SOLO, Shard, ffn_slice, shard_layer
from moe_lightning.torch_dtypes import DTYPES
from moe_lightning.weights import ExpertWeights, LayerWeights, MlaWeights, ModelWeights, Weight

# a layer's tensors that are one page each (the MLPs' and experts' are two)
DENSE_FIELDS = (
    "attn_norm",
    "wqkv",
    "wo",
    "ffn_norm",
    "router",
    "router_bias",
    "q_norm",
    "k_norm",
    "wqkv_bias",
    "shared_gate",
    "wo_bias",
    "sinks",
)

PAGE_DTYPES: dict[str, torch.dtype] = {**DTYPES, "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32}


def fill_arena(
    arena: torch.Tensor, layout: ArenaLayout, model_dir: str | Path, spec: ModelSpec, progress: bool = True
) -> None:
    """Converts the checkpoint into `arena` (a uint8 tensor of layout.total_bytes), layer by layer;
    experts are quantized (round to nearest) when the layout's format asks for it and the checkpoint
    is not quantized already."""
    from tqdm import tqdm

    reader = CheckpointReader(model_dir)
    skip_extra_layers(reader, spec)
    dtype = DTYPES[next(iter(layout.pages.values())).dtype]
    scheme = layout.expert_scheme()
    ranks = layout.ranks()

    def put(name: str, t: torch.Tensor) -> None:
        view(arena, layout.pages[name]).copy_(t)

    def put_expert(name: str, w: Weight) -> None:
        if not scheme.quantized:
            if isinstance(w, QuantizedLinear) and w.format is QuantFormat.MXFP4:  # widened exactly
                w = w.dequantize(dtype)
            if not isinstance(w, torch.Tensor):
                raise ValueError(f"the checkpoint's experts are quantized ({w.format}); run with --quantize auto")
            put(name, w)
            return
        if w.format is not scheme.format or w.group_size != view_group(layout, name, w):
            held = f"{w.format} with group size {w.group_size}"
            raise ValueError(f"{name}: the checkpoint holds {held}, the arena was laid out for {scheme.key()}")
        for part, t in w.components():
            put(f"{name}.{part}", t)
        if f"{name}.perm" in layout.pages and w.perm is None:  # in order already (GPTQ desc_act, trivial g_idx)
            perm = layout.pages[f"{name}.perm"]
            put(f"{name}.perm", torch.arange(perm.shape[1], dtype=torch.int32).expand(perm.shape))

    d, v = spec.hidden_size, spec.vocab_size
    names = top_names(spec)
    put("embed", reader.get(names.embed, (v, d)))
    if "lm_head" in layout.pages:
        put("lm_head", reader.weight(names.lm_head.removesuffix(".weight"), (v, d)))  # GPTQModel may quantize it
    put("final_norm", reader.get(names.final_norm, (d,)))
    desc = "converting layers" if not scheme.quantized else f"converting layers ({scheme.key()} experts)"
    for i in tqdm(range(spec.num_layers), desc=desc, unit="layer", disable=not progress, leave=False):
        layer = load_layer(reader, spec, i, dtype, "cpu")
        p = f"layers.{i}"
        for field in DENSE_FIELDS:
            if getattr(layer, field) is not None:
                put(f"{p}.{field}", getattr(layer, field))
        for kind, mlp in (("shared", layer.shared), ("mlp", layer.mlp)):
            if mlp is not None:
                put(f"{p}.{kind}.w13", mlp.w13)
                put(f"{p}.{kind}.w2", mlp.w2)
        if layer.mla is not None:
            for name, t in layer.mla.named():
                put(f"{p}.mla.{name}", t)
        for e, expert in enumerate(layer.experts):
            full = expert
            if scheme.quantized:  # the whole weight, then sliced: int8's per-row scales span every rank
                w13, w2 = (_to_scheme(w, scheme) for w in (expert.w13, expert.w2))
                full = ExpertWeights(w13, w2, expert.b13, expert.b2)
            for r in range(ranks) if ranks > 1 else (None,):
                part = full if r is None else ffn_slice(full.w13, full.w2, spec.intermediate_size, Shard(r, ranks))
                n13, n2 = expert_page_names(i, e, r)
                put_expert(n13, part.w13)
                put_expert(n2, part.w2)
                for name, bias in ((n13, part.b13), (n2, part.b2)):
                    if bias is not None:
                        put(f"{name}_bias", bias)


def _to_scheme(w: Weight, scheme: QuantScheme) -> Weight:
    """A checkpoint's expert weight in the arena's format: quantized (round to nearest) when dense; an
    MXFP4 one (GPT-OSS as published) dequantized first when the arena asks for another format; any
    other quantized one as it is (fill_arena's put_expert refuses a mismatch)."""
    if isinstance(w, QuantizedLinear) and w.format is QuantFormat.MXFP4 and scheme.format is not QuantFormat.MXFP4:
        w = w.dequantize(torch.float32)
    return quantize(w, scheme) if isinstance(w, torch.Tensor) else w


def view_group(layout: ArenaLayout, name: str, w: QuantizedLinear) -> int:
    """The group size the layout gives the quantized weight `name` (w's own when it is not int4)."""
    if w.format is not QuantFormat.INT4:
        return w.group_size
    return w.in_features // layout.pages[f"{name}.scales"].shape[1]


def view(arena: torch.Tensor, page: Page) -> torch.Tensor:
    return arena[page.offset : page.offset + page.nbytes].view(PAGE_DTYPES[page.dtype]).view(page.shape)


def _expert_weight(arena: torch.Tensor, layout: ArenaLayout, name: str, scheme: QuantScheme) -> Weight:
    if not scheme.quantized:
        return view(arena, layout.pages[name])
    parts = {
        part: view(arena, layout.pages[f"{name}.{part}"])
        for part in ("qweight", "scales", "zeros", "perm")
        if f"{name}.{part}" in layout.pages
    }
    return QuantizedLinear(scheme.format, **parts)


def weights_from_arena(
    arena: torch.Tensor,
    layout: ArenaLayout,
    spec: ModelSpec,
    device: torch.device | str = "cpu",
    experts_on_host: bool = False,
    shard: Shard = SOLO,
) -> ModelWeights:
    """ModelWeights over the arena: zero-copy views on the CPU, copies on another device.

    `experts_on_host`: leave every expert as an arena view (a pager decides what goes to the device).
    `shard`: a tensor-parallel rank's part: its experts' slices (views of its pages) and copies of its
    slices of the dense weights; the head only on the rank that samples (rank 0).
    """
    dev = torch.device(device)
    scheme = layout.expert_scheme()
    if layout.ranks() != shard.world:
        raise ValueError(
            f"the weight store laid the experts out for {layout.ranks()} rank(s), this is rank {shard.rank} of "
            f"{shard.world}: start the weight store with --tensor-parallel {shard.world}"
        )
    rank = shard.rank if shard.world > 1 else None

    def get(name: str) -> torch.Tensor:
        return view(arena, layout.pages[name])

    def on_device(t: torch.Tensor) -> torch.Tensor:
        return t if dev.type == "cpu" else t.to(dev)

    def expert(i: int, e: int) -> ExpertWeights:
        names = expert_page_names(i, e, rank)
        biases = (get(f"{n}_bias") if spec.expert_bias else None for n in names)
        w = ExpertWeights(*(_expert_weight(arena, layout, n, scheme) for n in names), *biases)
        return w if experts_on_host or dev.type == "cpu" else w.to(dev)

    def dense_on_device(layer: LayerWeights) -> LayerWeights:
        fields = DENSE_FIELDS
        moved = {f: on_device(getattr(layer, f)) for f in fields if getattr(layer, f) is not None}
        mlps = {f: getattr(layer, f).to(dev) for f in ("shared", "mlp") if getattr(layer, f) is not None}
        if layer.mla is not None:
            mlps["mla"] = MlaWeights(**{name: on_device(t) for name, t in layer.mla.named()})
        return replace(layer, **moved, **mlps)

    embed = on_device(get("embed"))
    layers = []
    for i in range(spec.num_layers):
        p = f"layers.{i}"
        sparse = spec.is_sparse(i)
        shared = sparse and spec.shared_expert_size > 0
        mla = spec.attention == "mla"
        layer = LayerWeights(
            attn_norm=get(f"{p}.attn_norm"),
            wqkv=None if mla else get(f"{p}.wqkv"),
            mla=MlaWeights(**{n: get(f"{p}.mla.{n}") for n, _ in mla_shapes(spec)}) if mla else None,
            wo=get(f"{p}.wo"),
            ffn_norm=get(f"{p}.ffn_norm"),
            router=get(f"{p}.router") if sparse else None,
            experts=[expert(i, e) for e in range(spec.experts_in(i))],
            q_norm=get(f"{p}.q_norm") if spec.qk_norm else None,
            k_norm=get(f"{p}.k_norm") if spec.qk_norm else None,
            wqkv_bias=get(f"{p}.wqkv_bias") if spec.qkv_bias else None,
            shared=ExpertWeights(get(f"{p}.shared.w13"), get(f"{p}.shared.w2")) if shared else None,
            shared_gate=get(f"{p}.shared_gate") if shared and spec.shared_expert_gate else None,
            router_bias=get(f"{p}.router_bias") if sparse and spec.router_score != "softmax" else None,
            wo_bias=get(f"{p}.wo_bias") if spec.o_bias else None,
            sinks=get(f"{p}.sinks") if spec.attention_sinks else None,
            mlp=None if sparse else ExpertWeights(get(f"{p}.mlp.w13"), get(f"{p}.mlp.w2")),
        )
        layers.append(dense_on_device(shard_layer(spec, layer, shard)))
    lm_head = embed[:0]  # only rank 0 samples: no copy of the head elsewhere
    if shard.leads:
        lm_head = on_device(get("lm_head")) if "lm_head" in layout.pages else embed
    return ModelWeights(embed=embed, layers=layers, final_norm=on_device(get("final_norm")), lm_head=lm_head)
