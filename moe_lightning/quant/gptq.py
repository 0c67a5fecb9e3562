"""4-bit GPTQ checkpoints as AutoGPTQ, GPTQModel and optimum publish them, read into our int4 pages.

The published layout of one linear `<base>` with N outputs, K inputs and groups of G inputs:

    qweight int32 (K/8, N)    8 values along K per int32, input row k at bits 4 * (k % 8) of row k // 8
    qzeros  int32 (K/G, N/8)  the groups' integer zero points, packed along N the same way
    scales  float16 (K/G, N)
    g_idx   int32 (K,)        group of each input column (absent or k // G unless desc_act)

    W[n, k] = scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])

where z is the stored zero + 1 in the original format ("gptq", the one most checkpoints are in: it
stores zero - 1) and the stored zero itself in "gptq_v2". The conversion is lossless: q is kept, our
scales are GPTQ's (fp16 -> fp32 is exact) and our weight-domain zero scale * (8 - z) is exact in fp32,
so our dequantized weight equals W bit for bit. With desc_act, g_idx scatters each group over the
input columns; a stable sort by group makes the groups contiguous again, which is our `perm`.

Only experts stay quantized; the other linears GPTQ quantized (attention, dense and shared MLPs) are
dequantized at load, since they are small next to the experts and run on the dense path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_lightning.checkpoint_error import CheckpointError
from moe_lightning.quant.gptq_config import GPTQConfig, read_gptq_config
from moe_lightning.quant.kernels import QuantizedLinear
from moe_lightning.quant.rtn import pack_int4
from moe_lightning.quant.scheme import QuantFormat, QuantScheme
from moe_lightning.safetensors_files import SafetensorsFiles
from moe_lightning.weights import ExpertWeights

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # bit offset of each of the 8 values in an int32


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """(R, C) int32 -> (8R, C) values in [0, 15]: row r at bits 4 * (r % 8) of packed[r // 8]."""
    vals = (packed[:, None, :] >> _SHIFTS[None, :, None]) & 15  # & 15 undoes the sign of >> on int32
    return vals.reshape(-1, packed.shape[1])


def _unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """(R, C) int32 -> (R, 8C), packed along the columns the same way."""
    return ((packed[:, :, None] >> _SHIFTS) & 15).reshape(packed.shape[0], -1)


@dataclass(slots=True)
class GPTQLinear:
    """One published linear, unpacked: q (N, K) uint8 in [0, 15], scales and integer zeros (N, K/G)
    float32 (the zeros already offset for the checkpoint format), g_idx (K,) int64."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scales.shape[1]

    def trivial(self) -> bool:
        return torch.equal(self.g_idx, torch.arange(self.q.shape[1]) // self.group_size)


def _int32(reader: SafetensorsFiles, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    t = reader.get(name, shape)
    if t.dtype != torch.int32:
        raise CheckpointError(f"tensor {name!r} is {t.dtype}, a GPTQ checkpoint packs it as int32")
    return t


def read_gptq_linear(
    reader: SafetensorsFiles, base: str, config: GPTQConfig, shape: tuple[int, int] | None = None
) -> GPTQLinear:
    """`shape`: the (N, K) the model expects; None takes it from the tensors."""
    if shape is None:
        packed = reader.entry(f"{base}.qweight").shape
        if len(packed) != 2:
            raise CheckpointError(f"tensor {base}.qweight has shape {list(packed)}, expected 2 dimensions")
        shape = (packed[1], packed[0] * 8)
    n, k = shape
    if k % 8 or n % 8:
        raise CheckpointError(f"{base}: GPTQ packs 8 values per int32, but its shape is {n} x {k}")
    group = k if config.group_size == -1 else config.group_size
    if k % group:
        raise CheckpointError(f"{base}: group size {group} does not divide its input width {k}")
    groups = k // group
    q = _unpack_rows(_int32(reader, f"{base}.qweight", (k // 8, n))).t().to(torch.uint8)  # (N, K)
    zeros = _unpack_cols(_int32(reader, f"{base}.qzeros", (groups, n // 8))).t().float() + config.zero_offset
    scales = reader.get(f"{base}.scales", (groups, n)).t().float()
    if f"{base}.g_idx" in reader:
        g_idx = reader.get(f"{base}.g_idx", (k,)).long()
        counts = torch.bincount(g_idx.clamp(0, groups), minlength=groups + 1)
        if g_idx.min() < 0 or g_idx.max() >= groups or (counts[:groups] != group).any():
            raise CheckpointError(f"{base}.g_idx must give each of the {groups} groups exactly {group} columns")
    else:
        g_idx = torch.arange(k) // group
    return GPTQLinear(q.contiguous(), scales.contiguous(), zeros.contiguous(), g_idx)


def dequantize_gptq(
    reader: SafetensorsFiles,
    base: str,
    config: GPTQConfig | None = None,
    shape: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The dense (N, K) float32 weight of the quantized linear `<base>` (exact: see the module doc)."""
    if config is None:
        config = read_gptq_config(reader.model_dir)
        if config is None:
            raise CheckpointError(f"{reader.model_dir}: not a GPTQ checkpoint, {base} has no quantized weight")
    lin = read_gptq_linear(reader, base, config, shape)
    return (lin.q.float() - lin.zeros[:, lin.g_idx]) * lin.scales[:, lin.g_idx]


def to_int4(lin: GPTQLinear) -> tuple[QuantizedLinear, torch.Tensor | None]:
    """Our int4 page of one linear and its input order (None when g_idx is already k // G)."""
    perm = None if lin.trivial() else torch.sort(lin.g_idx, stable=True).indices
    q = lin.q if perm is None else lin.q[:, perm]
    # (q - z) * s = (q - 8) * s + s * (8 - z): the zero moved into the weights' domain
    zeros = lin.scales * (8 - lin.zeros)
    ql = QuantizedLinear(QuantFormat.INT4, pack_int4(q).contiguous(), lin.scales, zeros.contiguous())
    return ql, perm


def _fuse(base: str, parts: list[tuple[QuantizedLinear, torch.Tensor | None]], scheme: QuantScheme) -> QuantizedLinear:
    """The row-concatenation of `parts` (gate and up, or down alone), with one input order per part."""
    perm = None
    if scheme.act_order:
        k = parts[0][0].in_features
        orders = [torch.arange(k) if p is None else p for _, p in parts]
        perm = torch.stack(orders).to(torch.int32).contiguous()
    elif any(p is not None for _, p in parts):
        raise CheckpointError(f"{base}: g_idx is an activation order, but the checkpoint's config has no desc_act")
    ql = QuantizedLinear(
        QuantFormat.INT4,
        torch.cat([q.qweight for q, _ in parts]),
        torch.cat([q.scales for q, _ in parts]),
        torch.cat([q.zeros for q, _ in parts if q.zeros is not None]),
        perm,
    )
    expected = scheme.components(ql.out_features, ql.in_features, len(parts))
    got = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in ql.components()]
    if got != expected:  # every expert page of a model has the scheme's layout, or pages cannot be swapped
        raise CheckpointError(f"{base}: converted to {got}, but int4 scheme {scheme.key()} needs {expected}")
    return ql


def load_gptq_expert(
    reader: SafetensorsFiles, bases: tuple[str, str, str], d: int, inter: int, config: GPTQConfig
) -> ExpertWeights:
    """An expert from its gate, up and down linears (names without .qweight), kept int4 on the CPU."""
    gate, up, down = bases
    w13 = _fuse(
        gate,
        [to_int4(read_gptq_linear(reader, b, config, (inter, d))) for b in (gate, up)],
        config.scheme,
    )
    w2 = _fuse(down, [to_int4(read_gptq_linear(reader, down, config, (d, inter)))], config.scheme)
    return ExpertWeights(w13, w2)
