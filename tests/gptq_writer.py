"""Writes a 4-bit GPTQ checkpoint in the layout AutoGPTQ / GPTQModel publish, from a float checkpoint,
and beside it the float checkpoint it stands for (every quantized linear dequantized): the reference.

Written from the format's definition, value by value over numpy, and sharing no code with the loader:
qweight int32 (K/8, N) holds input row k at bits 4 * (k % 8) of row k // 8; qzeros int32 (K/G, N/8)
the zero points packed along N the same way (stored minus 1 in the v1 "gptq" format); scales fp16
(K/G, N); g_idx int32 (K,) the group of each input column. W[n, k] = scales[g, n] * (q - z), g = g_idx[k].
Quantization is round-to-nearest (what GPTQ's quantizer does per group, without its error feedback).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

# the linears GPTQ quantizes: attention, experts, dense and shared MLPs (not routers, norms, embed, lm_head)
QUANTIZED = re.compile(
    r"(self_attn\.[qkvo]_proj|experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)|mlp\.(shared_expert\.)?"
    r"(gate|up|down)_proj)$"
)


def quantize_rtn(
    w: np.ndarray, group_size: int, order: np.ndarray, sym: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """w (N, K) float32 -> q (N, K), scales (K/G, N) fp16, zeros (K/G, N) int, g_idx (K,), the groups
    formed over the columns in `order` (the act order; arange for none)."""
    n, k = w.shape
    g = k if group_size == -1 else group_size
    g_idx = np.empty(k, dtype=np.int64)
    g_idx[order] = np.arange(k) // g
    q = np.zeros((n, k), dtype=np.int64)
    scales = np.zeros((k // g, n), dtype=np.float16)
    zeros = np.zeros((k // g, n), dtype=np.int64)
    for j in range(k // g):
        cols = order[j * g : (j + 1) * g]
        wg = w[:, cols]
        if sym:  # symmetric: the zero point is the middle of [0, 15]
            scale = 2 * np.abs(wg).max(axis=1) / 15
            zero = np.full(n, 8)
        else:
            lo, hi = np.minimum(wg.min(axis=1), 0), np.maximum(wg.max(axis=1), 0)
            scale = (hi - lo) / 15
            # v1 stores zero - 1 in 4 bits, so a zero of 0 has no encoding: keep it in [1, 15]
            zero = np.clip(np.round(-lo / np.maximum(scale, 1e-12)), 1, 15).astype(np.int64)
        s16 = np.maximum(scale, 1e-4).astype(np.float16)
        s = s16.astype(np.float32)[:, None]
        q[:, cols] = np.clip(np.round(wg / s) + zero[:, None], 0, 15)
        scales[j], zeros[j] = s16, zero
    return q, scales, zeros, g_idx


def dequantize(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray, g_idx: np.ndarray) -> np.ndarray:
    n, k = q.shape
    w = np.zeros((n, k), dtype=np.float32)
    for col in range(k):
        g = g_idx[col]
        w[:, col] = scales[g].astype(np.float32) * (q[:, col] - zeros[g]).astype(np.float32)
    return w


def pack_rows(vals: np.ndarray) -> np.ndarray:
    """(R, C) values in [0, 15] -> (R/8, C) int32, row r at bits 4 * (r % 8) of row r // 8."""
    out = np.zeros((vals.shape[0] // 8, vals.shape[1]), dtype=np.uint32)
    for r in range(vals.shape[0]):
        out[r // 8] |= vals[r].astype(np.uint32) << np.uint32(4 * (r % 8))
    return out.view(np.int32)


def pack_cols(vals: np.ndarray) -> np.ndarray:
    """(R, C) values in [0, 15] -> (R, C/8) int32, column c at bits 4 * (c % 8) of column c // 8."""
    out = np.zeros((vals.shape[0], vals.shape[1] // 8), dtype=np.uint32)
    for c in range(vals.shape[1]):
        out[:, c // 8] |= vals[:, c].astype(np.uint32) << np.uint32(4 * (c % 8))
    return out.view(np.int32)


def gptq_tensors(
    base: str, w: np.ndarray, group_size: int, order: np.ndarray, sym: bool, fmt: str, g_idx_stored: bool
) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """The published tensors of one linear and its dequantized weight."""
    q, scales, zeros, g_idx = quantize_rtn(w, group_size, order, sym)
    stored_zeros = zeros - 1 if fmt == "gptq" else zeros
    out = {
        f"{base}.qweight": torch.from_numpy(pack_rows(q.T)),  # (K, N) packed along K
        f"{base}.qzeros": torch.from_numpy(pack_cols(stored_zeros)),
        f"{base}.scales": torch.from_numpy(scales),
    }
    if g_idx_stored:
        out[f"{base}.g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
    return out, dequantize(q, scales, zeros, g_idx)


def write_gptq(
    src: Path,
    out: Path,
    ref: Path,
    group_size: int = 128,
    desc_act: bool = False,
    sym: bool = True,
    fmt: str = "gptq",
    seed: int = 0,
    config_in: str = "config.json",
    g_idx_stored: bool = True,
    lm_head: bool = False,
) -> tuple[Path, Path]:
    """GPTQ checkpoint of `src` into `out`, its dequantized float twin into `ref`. desc_act: a random
    act order per linear. config_in: config.json (quantization_config, as transformers writes it) or
    quantize_config.json (as AutoGPTQ does). lm_head: quantize it too (GPTQModel's lm_head option)."""
    rng = np.random.default_rng(seed)
    quantized: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        base = name.removesuffix(".weight")
        if name == base or not (QUANTIZED.search(base) or (lm_head and base == "lm_head")):
            quantized[name] = reference[name] = t
            continue
        w = t.float().numpy()
        order = rng.permutation(w.shape[1]) if desc_act else np.arange(w.shape[1])
        tensors, dense = gptq_tensors(base, w, group_size, order, sym, fmt, g_idx_stored)
        quantized.update(tensors)
        reference[name] = torch.from_numpy(dense).to(t.dtype)
    config = json.loads((src / "config.json").read_text())
    qconfig: dict[str, Any] = dict(
        quant_method="gptq", bits=4, group_size=group_size, desc_act=desc_act, sym=sym, checkpoint_format=fmt
    )
    if lm_head:
        qconfig["lm_head"] = True
    for d, sd in ((out, quantized), (ref, reference)):
        d.mkdir(parents=True, exist_ok=True)
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        for f in src.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                shutil.copy(f, d / f.name)
    (ref / "config.json").write_text(json.dumps(config, indent=2))
    if config_in == "config.json":
        config = {**config, "quantization_config": qconfig}
    else:
        (out / "quantize_config.json").write_text(json.dumps(qconfig, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out, ref
