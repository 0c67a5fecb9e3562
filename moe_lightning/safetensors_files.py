"""Name -> tensor access over the safetensors files of an HF model directory (one file, a sharded
index, or every *.safetensors there), each header checked (safetensors_header.py) before any tensor is
mapped. What a tensor means (our layout, GPTQ's packing) is checkpoint.py's and quant/gptq.py's."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import safe_open

from moe_lightning.checkpoint_error import CheckpointError
from moe_lightning.safetensors_header import TensorEntry, read_safetensors_header
from moe_lightning.safetensors_names import checkpoint_files

# elements reduced at a time: the exact look at a chunk that holds a non-finite value stays small
FINITE_CHUNK = 1 << 22


def check_finite(t: torch.Tensor, what: str) -> None:
    """Raises CheckpointError naming `what` if the float tensor `t` holds a NaN or an infinity: such a
    weight makes every logit it reaches NaN, so each sampled request would fail at its first step.
    Every tensor is checked as it is read (in the pass that converts it into the arena: the file is
    read once), by each chunk's minimum and maximum (one vectorised pass in the tensor's own dtype, no
    temporary; a NaN propagates into both, an infinity is one of them): 4-5 GB/s on one core of the
    dev VM, where isfinite().all() ran at 0.35."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    flat = t.reshape(-1)
    for start in range(0, flat.numel(), FINITE_CHUNK):
        chunk = flat[start : start + FINITE_CHUNK]
        low, high = torch.aminmax(chunk)
        if math.isfinite(float(low)) and math.isfinite(float(high)):
            continue
        finite = torch.isfinite(chunk)
        nan, inf = int(torch.isnan(chunk).sum()), int(torch.isinf(chunk).sum())
        at = start + int((~finite).nonzero()[0, 0])
        raise CheckpointError(
            f"{what} holds non-finite values (from element {at}: {nan} NaN and {inf} infinite in "
            f"its elements {start}..{start + chunk.numel() - 1}); the checkpoint is damaged"
        )


class SafetensorsFiles:
    """The tensors of every safetensors file of `model_dir`, by name."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        files = checkpoint_files(self.model_dir)
        self.entries: dict[str, TensorEntry] = {}
        for file in files:
            self.entries.update(read_safetensors_header(file))
        self._handles: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.entries[name]
        except KeyError:
            files = sorted({e.file.name for e in self.entries.values()})
            raise CheckpointError(
                f"tensor {name!r} is missing from the checkpoint (files: {', '.join(files)})"
            ) from None

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        entry = self.entry(name)
        if shape is not None and entry.shape != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} in {entry.file.name} has shape {list(entry.shape)}, expected {list(shape)}"
            )
        try:
            handle = self._handles.get(entry.file)
            if handle is None:
                handle = safe_open(str(entry.file), framework="pt")
                self._handles[entry.file] = handle
            t = handle.get_tensor(name)  # type: ignore[attr-defined]
        except Exception as exc:  # the header was checked; this is the file changing under us, or a library bug
            raise CheckpointError(f"{entry.file}: cannot read tensor {name!r}: {exc}") from exc
        check_finite(t, f"{entry.file}: tensor {name!r}")
        return t

    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())
