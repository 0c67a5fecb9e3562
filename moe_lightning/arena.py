"""The paged weight arena: every weight of our layout is one page, 4 KiB aligned, in one region.

The weight store fills it (from the checkpoint or its on-disk converted copy); every other process
maps it and builds `ModelWeights` as views, so the weights exist once in host memory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_lightning.checkpoint import INDEX_FILE, CheckpointReader, load_layer, top_names
from moe_lightning.spec import DTYPES, ModelSpec
from moe_lightning.weights import ExpertWeights, LayerWeights, ModelWeights

PAGE_ALIGN = 4096
LAYOUT_VERSION = 2  # bump when the page set or order changes: invalidates on-disk copies


@dataclass(frozen=True, slots=True)
class Page:
    name: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ArenaLayout:
    pages: dict[str, Page]
    total_bytes: int

    @classmethod
    def for_spec(cls, spec: ModelSpec, dtype: str) -> ArenaLayout:
        elem = torch.empty((), dtype=DTYPES[dtype]).element_size()
        pages: dict[str, Page] = {}
        offset = 0
        for name, shape in page_shapes(spec):
            n = elem
            for s in shape:
                n *= s
            pages[name] = Page(name, offset, n, dtype, shape)
            offset = (offset + n + PAGE_ALIGN - 1) // PAGE_ALIGN * PAGE_ALIGN
        return cls(pages, offset)


def page_shapes(spec: ModelSpec) -> Iterator[tuple[str, tuple[int, ...]]]:
    d, v, inter = spec.hidden_size, spec.vocab_size, spec.intermediate_size
    yield "embed", (v, d)
    if not spec.tie_word_embeddings:
        yield "lm_head", (v, d)
    yield "final_norm", (d,)
    for i in range(spec.num_layers):
        p = f"layers.{i}"
        yield f"{p}.attn_norm", (d,)
        yield f"{p}.wqkv", (spec.q_size + 2 * spec.kv_size, d)
        yield f"{p}.wo", (d, spec.q_size)
        if spec.qk_norm is not None:
            q_norm, k_norm = spec.qk_norm_shapes()
            yield f"{p}.q_norm", (q_norm,)
            yield f"{p}.k_norm", (k_norm,)
        if spec.qkv_bias:
            yield f"{p}.wqkv_bias", (spec.q_size + 2 * spec.kv_size,)
        if spec.shared_expert_size and spec.is_sparse(i):  # part of the sparse block, not of a dense layer
            yield f"{p}.shared.w13", (2 * spec.shared_expert_size, d)
            yield f"{p}.shared.w2", (d, spec.shared_expert_size)
            yield f"{p}.shared_gate", (1, d)
        yield f"{p}.ffn_norm", (d,)
        if not spec.is_sparse(i):
            yield f"{p}.mlp.w13", (2 * spec.dense_intermediate_size, d)
            yield f"{p}.mlp.w2", (d, spec.dense_intermediate_size)
            continue
        yield f"{p}.router", (spec.num_experts, d)
        for e in range(spec.num_experts):
            yield f"{p}.experts.{e}.w13", (2 * inter, d)
            yield f"{p}.experts.{e}.w2", (d, inter)


def expert_page_names(layer: int, expert: int) -> tuple[str, str]:
    return f"layers.{layer}.experts.{expert}.w13", f"layers.{layer}.experts.{expert}.w2"


def checkpoint_key(model_dir: str | Path, dtype: str) -> str:
    """Identifies a checkpoint + target dtype cheaply: config, index, and each file's header/size/mtime."""
    root = Path(model_dir)
    h = hashlib.sha256(f"layout{LAYOUT_VERSION}:{dtype}".encode())
    for name in ("config.json", INDEX_FILE):
        if (root / name).is_file():
            h.update((root / name).read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(min(st.st_size, 1 << 20)))
    return h.hexdigest()[:24]


def fill_arena(
    arena: torch.Tensor, layout: ArenaLayout, model_dir: str | Path, spec: ModelSpec, progress: bool = True
) -> None:
    """Converts the checkpoint into `arena` (a uint8 tensor of layout.total_bytes), layer by layer."""
    from tqdm import tqdm

    reader = CheckpointReader(model_dir)
    dtype = DTYPES[next(iter(layout.pages.values())).dtype]

    def put(name: str, t: torch.Tensor) -> None:
        view(arena, layout.pages[name]).copy_(t)

    d, v = spec.hidden_size, spec.vocab_size
    names = top_names(spec)
    put("embed", reader.get(names.embed, (v, d)))
    if "lm_head" in layout.pages:
        put("lm_head", reader.get(names.lm_head, (v, d)))
    put("final_norm", reader.get(names.final_norm, (d,)))
    for i in tqdm(range(spec.num_layers), desc="converting layers", unit="layer", disable=not progress, leave=False):
        layer = load_layer(reader, spec, i, dtype, "cpu")
        p = f"layers.{i}"
        for field in ("attn_norm", "wqkv", "wo", "ffn_norm", "router", "q_norm", "k_norm", "wqkv_bias", "shared_gate"):
            if getattr(layer, field) is not None:
                put(f"{p}.{field}", getattr(layer, field))
        for kind, mlp in (("shared", layer.shared), ("mlp", layer.mlp)):
            if mlp is not None:
                put(f"{p}.{kind}.w13", mlp.w13)
                put(f"{p}.{kind}.w2", mlp.w2)
        for e, expert in enumerate(layer.experts):
            w13, w2 = expert_page_names(i, e)
            put(w13, expert.w13)
            put(w2, expert.w2)


def view(arena: torch.Tensor, page: Page) -> torch.Tensor:
    return arena[page.offset : page.offset + page.nbytes].view(DTYPES[page.dtype]).view(page.shape)


def weights_from_arena(
    arena: torch.Tensor,
    layout: ArenaLayout,
    spec: ModelSpec,
    device: torch.device | str = "cpu",
    experts_on_host: bool = False,
) -> ModelWeights:
    """ModelWeights over the arena: zero-copy views on the CPU, copies on another device.

    `experts_on_host`: leave every expert as an arena view (a pager decides what goes to the device).
    """
    dev = torch.device(device)

    def get(name: str, host: bool = False) -> torch.Tensor:
        t = view(arena, layout.pages[name])
        return t if host or dev.type == "cpu" else t.to(dev)

    embed = get("embed")
    layers = []
    for i in range(spec.num_layers):
        p = f"layers.{i}"
        experts = [
            ExpertWeights(*(get(n, experts_on_host) for n in expert_page_names(i, e)))
            for e in range(spec.experts_in(i))
        ]
        sparse = spec.is_sparse(i)
        shared = sparse and spec.shared_expert_size > 0
        layers.append(
            LayerWeights(
                attn_norm=get(f"{p}.attn_norm"),
                wqkv=get(f"{p}.wqkv"),
                wo=get(f"{p}.wo"),
                ffn_norm=get(f"{p}.ffn_norm"),
                router=get(f"{p}.router") if sparse else None,
                experts=experts,
                q_norm=get(f"{p}.q_norm") if spec.qk_norm else None,
                k_norm=get(f"{p}.k_norm") if spec.qk_norm else None,
                wqkv_bias=get(f"{p}.wqkv_bias") if spec.qkv_bias else None,
                shared=ExpertWeights(get(f"{p}.shared.w13"), get(f"{p}.shared.w2")) if shared else None,
                shared_gate=get(f"{p}.shared_gate") if shared else None,
                mlp=None if sparse else ExpertWeights(get(f"{p}.mlp.w13"), get(f"{p}.mlp.w2")),
            )
        )
    lm_head = get("lm_head") if "lm_head" in layout.pages else embed
    return ModelWeights(embed=embed, layers=layers, final_norm=get("final_norm"), lm_head=lm_head)


def layout_to_json(layout: ArenaLayout) -> str:
    return json.dumps(
        {
            "total_bytes": layout.total_bytes,
            "pages": [[p.name, p.offset, p.nbytes, p.dtype, list(p.shape)] for p in layout.pages.values()],
        }
    )


def layout_from_json(text: str) -> ArenaLayout:
    obj = json.loads(text)
    pages = {n: Page(n, o, b, d, tuple(s)) for n, o, b, d, s in obj["pages"]}
    return ArenaLayout(pages, obj["total_bytes"])
