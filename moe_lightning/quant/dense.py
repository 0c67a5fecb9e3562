"""--quantize-dense: the attention projections (q/k/v, o) and the LM head quantized where gpu_expert
computes them, as llama.cpp's q8_0 / q4_0 files quantize every 2-D weight but the router.

At a decode step's row counts these GEMMs read their weights once per step, so their time is their
bytes: in fp32 on the 2-core dev VM the q/k/v projections and the head were 48-50 ms of a 220 ms
64-prompt step of the `bench` model (docs/cgopipe-and-benchmarks.md). int8 per output channel holds a
quarter of the bytes, and the same raced kernels as the expert pages run it (quant/kernels.py).

The arena (and so the weight store and a checkpoint's conversion) keeps them in the model's dtype;
each rank quantizes its own slice at start, so under tensor parallelism the scales of o_proj (split
by columns) are its slice's. The router stays in the model's dtype (its logits pick the experts), and
so do the embeddings (a lookup reads one row a token)."""

from __future__ import annotations

import torch

from moe_lightning.quant.kernels import QuantizedLinear
from moe_lightning.quant.rtn import quantize
from moe_lightning.quant.scheme import QuantFormat, QuantScheme
from moe_lightning.weights import ModelWeights

FORMATS = {"int8": QuantScheme(QuantFormat.INT8)}  # --quantize-dense's choices beside "none"


def quantize_dense(weights: ModelWeights, fmt: str) -> int:
    """Replaces `weights`' q/k/v, o and LM head by their `fmt` form (in place, on their device; "none":
    nothing). MLA's projections stay as they are. Returns the bytes saved."""
    if fmt == "none":
        return 0
    scheme = FORMATS[fmt]
    before = weights.nbytes()
    for layer in weights.layers:
        if isinstance(layer.wqkv, torch.Tensor):
            layer.wqkv = quantize_rows(layer.wqkv, scheme)
        if isinstance(layer.wo, torch.Tensor):
            layer.wo = quantize_rows(layer.wo, scheme)
    if isinstance(weights.lm_head, torch.Tensor) and weights.lm_head.numel():  # empty on a rank that does not sample
        weights.lm_head = quantize_rows(weights.lm_head, scheme)
    return before - weights.nbytes()


def quantize_rows(w: torch.Tensor, scheme: QuantScheme, rows: int | None = None) -> QuantizedLinear:
    """rtn.quantize of (N, K) `w`, `rows` output rows at a time (default: the device's block,
    scheme.dequant_chunk: 64 Mi weights on CUDA, so one block's float32 copy is 256 MiB): quantize
    works in fp32, and a whole bf16 LM head in fp32 (DeepSeek-V3's: 3.7 GB) would not fit beside the
    model on a GPU sized for it. Per output channel, so the rows' parts simply stack."""
    assert scheme.format is QuantFormat.INT8
    return quantize(w, scheme, rows)
