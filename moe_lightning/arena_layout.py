"""The arena's layout: which page holds what, at which offset, in which dtype and shape (the arena
itself, and filling it, are moe_lightning/arena.py). Plain numbers, no tensors: the orchestrator reads
layouts without importing torch."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from moe_lightning.quant.scheme import COMPONENT_ALIGN, QuantFormat, QuantScheme, scheme_of
from moe_lightning.safetensors_names import INDEX_FILE
from moe_lightning.spec import ModelSpec

PAGE_ALIGN = 4096
LAYOUT_VERSION = 3  # bump when the page set or order changes: invalidates on-disk copies
# bytes per element of a page's dtype (arena.PAGE_DTYPES maps the same names to torch's dtypes)
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "int32": 4}


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
    def for_spec(cls, spec: ModelSpec, dtype: str, scheme: QuantScheme | None = None, ranks: int = 1) -> ArenaLayout:
        """`ranks`: tensor-parallel ranks the experts are laid out for (each rank's slice one range)."""
        scheme = scheme or QuantScheme()
        pages: dict[str, Page] = {}
        offset = 0
        for name, shape in page_shapes(spec, ranks):
            parts = _expert_parts(name, shape, scheme) if ".experts." in name and not name.endswith("_bias") else []
            parts = parts or [(name, "float32" if _kept_fp32(spec, name) else dtype, shape)]
            for k, (part, part_dtype, part_shape) in enumerate(parts):
                n = ITEMSIZE[part_dtype] * math.prod(part_shape)
                pages[part] = Page(part, offset, n, part_dtype, part_shape)
                # an expert's weights (their parts, their biases) stay together: one range, one transfer
                last = not (".experts." in name and not name.endswith(_last_expert_part(spec)))
                together = k < len(parts) - 1 or name.endswith(".w13") or not last
                align = COMPONENT_ALIGN if together else PAGE_ALIGN
                offset = (offset + n + align - 1) // align * align
        return cls(pages, offset)

    def expert_scheme(self) -> QuantScheme:
        """The experts' format, read off the pages (a manifest carries no other description)."""
        name = next((n for n in self.pages if ".experts." in n and ".w13" in n), None)
        if name is None:
            raise ValueError("the arena has no expert pages")
        if name.endswith(".w13"):
            return QuantScheme()
        base = name.rsplit(".", 1)[0]
        w2 = base.removesuffix(".w13") + ".w2"
        q = self.pages[f"{base}.qweight"]
        if self.pages[f"{base}.scales"].dtype == "uint8":  # e8m0 scales: MXFP4 (its block fixed at 32)
            return QuantScheme(QuantFormat.MXFP4)
        fmt = QuantFormat.INT8 if q.dtype == "int8" else QuantFormat.INT4
        widths = tuple(self.pages[f"{b}.qweight"].shape[1] * (2 if fmt is QuantFormat.INT4 else 1) for b in (base, w2))
        groups = tuple(self.pages[f"{b}.scales"].shape[-1] if fmt is QuantFormat.INT4 else 1 for b in (base, w2))
        return scheme_of(fmt, widths, groups, act_order=f"{base}.perm" in self.pages)  # type: ignore[arg-type]

    def ranks(self) -> int:
        """The tensor-parallel ranks the experts are laid out for (1: not split)."""
        first = next((n for n in self.pages if ".experts." in n), "")
        if ".rank" not in first:
            return 1
        base = first.split(".rank")[0] + ".rank"
        return len({n[len(base) :].split(".")[0] for n in self.pages if n.startswith(base)})

    def expert_page_bytes(self, layer: int, expert: int = 0, rank: int | None = None) -> int:
        """The bytes one expert's range spans (what streaming it moves); of one rank's slice when
        `rank` is given (None on a split layout: all ranks' slices)."""
        prefix = f"{expert_prefix(layer, expert, rank)}."
        parts = [p for n, p in self.pages.items() if n.startswith(prefix)]
        return max(p.offset + p.nbytes for p in parts) - min(p.offset for p in parts)


def _expert_parts(name: str, shape: tuple[int, ...], scheme: QuantScheme) -> list[tuple[str, str, tuple[int, ...]]]:
    """A quantized expert weight's pages (none: it is one page in the model's dtype)."""
    if not scheme.quantized:
        return []
    parts = 2 if name.endswith(".w13") else 1
    return [(f"{name}.{suffix}", dt, shp) for suffix, dt, shp in scheme.components(*shape, parts)]


def _last_expert_part(spec: ModelSpec) -> str:
    return ".w2_bias" if spec.expert_bias else ".w2"


def _kept_fp32(spec: ModelSpec, name: str) -> bool:
    """A sigmoid router and its selection bias stay fp32 in any model dtype, as the reference keeps them
    (their scores pick the experts: a bf16 bias would tie and swap experts the reference keeps apart)."""
    return spec.router_score == "sigmoid" and name.endswith((".router", ".router_bias"))


def mla_shapes(spec: ModelSpec) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The pages of one layer's MLA projections (weights.MlaWeights's fields, o_proj aside: it is `wo`)."""
    d, h, c, r = spec.hidden_size, spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim
    n, qk = spec.qk_nope_head_dim, spec.qk_nope_head_dim + spec.qk_rope_head_dim
    yield "kv_a_proj_with_mqa", (c + r, d)
    yield "kv_a_layernorm", (c,)
    yield "w_uk", (h, n, c)
    yield "w_uv", (h, spec.v_head_dim, c)
    if spec.q_lora_rank is None:
        yield "q_proj", (h * qk, d)
    else:
        yield "q_a_proj", (spec.q_lora_rank, d)
        yield "q_a_layernorm", (spec.q_lora_rank,)
        yield "q_b_proj", (h * qk, spec.q_lora_rank)


def page_shapes(spec: ModelSpec, ranks: int = 1) -> Iterator[tuple[str, tuple[int, ...]]]:
    d, v, inter = spec.hidden_size, spec.vocab_size, spec.intermediate_size
    yield "embed", (v, d)
    if not spec.tie_word_embeddings:
        yield "lm_head", (v, d)
    yield "final_norm", (d,)
    for i in range(spec.num_layers):
        p = f"layers.{i}"
        yield f"{p}.attn_norm", (d,)
        if spec.attention == "mla":
            yield from ((f"{p}.mla.{name}", shape) for name, shape in mla_shapes(spec))
        else:
            yield f"{p}.wqkv", (spec.q_size + 2 * spec.kv_size, d)
        yield f"{p}.wo", (d, spec.o_proj_in)
        if spec.o_bias:
            yield f"{p}.wo_bias", (d,)
        if spec.attention_sinks:
            yield f"{p}.sinks", (spec.num_heads,)
        if spec.qk_norm is not None:
            q_norm, k_norm = spec.qk_norm_shapes()
            yield f"{p}.q_norm", (q_norm,)
            yield f"{p}.k_norm", (k_norm,)
        if spec.qkv_bias:
            yield f"{p}.wqkv_bias", (spec.q_size + 2 * spec.kv_size,)
        if spec.shared_expert_size and spec.is_sparse(i):  # part of the sparse block, not of a dense layer
            yield f"{p}.shared.w13", (2 * spec.shared_expert_size, d)
            yield f"{p}.shared.w2", (d, spec.shared_expert_size)
            if spec.shared_expert_gate:
                yield f"{p}.shared_gate", (1, d)
        yield f"{p}.ffn_norm", (d,)
        if not spec.is_sparse(i):
            yield f"{p}.mlp.w13", (2 * spec.dense_intermediate_size, d)
            yield f"{p}.mlp.w2", (d, spec.dense_intermediate_size)
            continue
        yield f"{p}.router", (spec.num_experts, d)
        if spec.router_score != "softmax":
            yield f"{p}.router_bias", (spec.num_experts,)
        for e in range(spec.num_experts):
            for r in range(ranks) if ranks > 1 else (None,):
                w13, w2 = expert_page_names(i, e, r)
                yield w13, (2 * inter // ranks, d)
                if spec.expert_bias:
                    yield f"{w13}_bias", (2 * inter // ranks,)
                yield w2, (d, inter // ranks)
                if spec.expert_bias:
                    yield f"{w2}_bias", (d,)


def expert_prefix(layer: int, expert: int, rank: int | None = None) -> str:
    return f"layers.{layer}.experts.{expert}" + ("" if rank is None else f".rank{rank}")


def expert_page_names(layer: int, expert: int, rank: int | None = None) -> tuple[str, str]:
    """The names an expert's two weights (or a rank's slices of them) start from (a quantized one
    adds `.qweight`, `.scales`, ...)."""
    prefix = expert_prefix(layer, expert, rank)
    return f"{prefix}.w13", f"{prefix}.w2"


def checkpoint_key(model_dir: str | Path, dtype: str, scheme: QuantScheme | None = None, ranks: int = 1) -> str:
    """Identifies a checkpoint + target dtype, expert format and ranks cheaply: config, index, and
    each file's header/size/mtime."""
    root = Path(model_dir)
    split = f":ranks{ranks}" if ranks > 1 else ""
    h = hashlib.sha256(f"layout{LAYOUT_VERSION}:{dtype}:{(scheme or QuantScheme()).key()}{split}".encode())
    for name in ("config.json", INDEX_FILE):
        if (root / name).is_file():
            h.update((root / name).read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(min(st.st_size, 1 << 20)))
    return h.hexdigest()[:24]


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
