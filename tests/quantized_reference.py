"""The reference for quantized experts: the same checkpoint with every expert weight replaced by
what our quantization makes of it (quantize, then dequantize), for transformers to run."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moe_lightning.quant.rtn import quantize
from moe_lightning.quant.scheme import QuantScheme

# per-expert Linear weights (Mixtral, OLMoE, Qwen-MoE; not Qwen2-MoE's shared expert, which is dense)
PER_EXPERT = re.compile(r"\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
# what --quantize-dense quantizes (moe_lightning/quant/dense.py): attention projections and the LM head
DENSE = re.compile(r"(\.self_attn\.(q|k|v|o)_proj\.weight|^lm_head\.weight)$")


def fake_quantize(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """(N, K) -> the (N, K) weight our pages hold for it, in w's dtype."""
    return quantize(w, scheme).dequantize().to(w.dtype)


def write_dequantized(
    src: Path,
    dst: Path,
    scheme: QuantScheme | None,
    experts_per_layer: int | None = None,
    dense: QuantScheme | None = None,
    ranks: int = 1,
) -> Path:
    """Copies the checkpoint at `src` to `dst` with its experts replaced by their dequantized pages
    (`scheme` None: kept), and with `dense`, the attention projections and LM head by theirs, as
    --quantize-dense makes them on `ranks` tensor-parallel ranks (o_proj's columns are split by rank,
    each rank quantizing its own)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    for f in src.glob("*.safetensors"):
        sd = load_file(f)
        for name, t in sd.items():
            if dense is not None and DENSE.search(name):
                cols = t.shape[1] // ranks if name.endswith("o_proj.weight") else t.shape[1]
                sd[name] = torch.cat([fake_quantize(c, dense) for c in t.split(cols, dim=1)], dim=1)
            elif scheme is None:
                continue
            elif PER_EXPERT.search(name) or name.endswith(("ffn.experts.mlp.w1", "ffn.experts.mlp.v1")):
                sd[name] = fake_quantize(t, scheme)
            elif name.endswith("ffn.experts.mlp.w2"):  # DBRX: expert j's w2 is block j transposed
                assert experts_per_layer is not None
                blocks = t.view(experts_per_layer, -1, t.shape[1])  # (E, I, D)
                sd[name] = torch.stack([fake_quantize(b.T, scheme).T for b in blocks]).view_as(t).contiguous()
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")) and f"{name}_bias" in sd:
                # GPT-OSS: (E, in, out), gate/up columns interleaved; our pages quantize per row of (out, in),
                # which the interleaving only reorders
                sd[name] = torch.stack([fake_quantize(w.T.contiguous(), scheme).T for w in t]).contiguous()
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # (E, out, in)
                sd[name] = fake_quantize(t.reshape(-1, t.shape[-1]), scheme).view_as(t)
        save_file(sd, dst / f.name, metadata={"format": "pt"})
    return dst
