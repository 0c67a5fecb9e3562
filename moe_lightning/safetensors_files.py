"""Name -> tensor access over the safetensors files of an HF model directory (one file, a sharded
index, or every *.safetensors there), each header checked (safetensors_header.py) before any tensor is
mapped. What a tensor means (our layout, GPTQ's packing) is checkpoint.py's and quant/gptq.py's."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from moe_lightning.checkpoint_error import CheckpointError
from moe_lightning.safetensors_header import TensorEntry, read_safetensors_header
from moe_lightning.safetensors_names import INDEX_FILE, SINGLE_FILE


class SafetensorsFiles:
    """The tensors of every safetensors file of `model_dir`, by name."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        files = self._files()
        self.entries: dict[str, TensorEntry] = {}
        for file in files:
            self.entries.update(read_safetensors_header(file))
        self._handles: dict[Path, object] = {}

    def _files(self) -> list[Path]:
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError, RecursionError) as exc:
                raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
            # shard names are files of this directory: a path would read outside the model
            if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) and f and Path(f).name == f for f in weight_map.values()
            ):
                raise CheckpointError(f"{index}: weight_map must map tensor names to file names in {self.model_dir}")
            files = sorted({self.model_dir / f for f in weight_map.values()})
            for f in files:
                if not f.is_file():
                    raise CheckpointError(f"{index} names shard {f.name}, which does not exist")
            return files
        single = self.model_dir / SINGLE_FILE
        if single.is_file():
            return [single]
        found = sorted(self.model_dir.glob("*.safetensors"))
        if not found:
            raise CheckpointError(f"{self.model_dir}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors found")
        return found

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
            return handle.get_tensor(name)  # type: ignore[attr-defined]
        except Exception as exc:  # the header was checked; this is the file changing under us, or a library bug
            raise CheckpointError(f"{entry.file}: cannot read tensor {name!r}: {exc}") from exc

    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())
