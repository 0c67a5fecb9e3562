"""The file names of a Hugging Face safetensors checkpoint, and which files of a model directory hold
its tensors. Torch-free: the weight store keys its arena copy on them (arena_layout.checkpoint_key),
and `up` compares a config's sizes with them (checkpoint_size.py), without importing torch."""

from __future__ import annotations

import json
from pathlib import Path

from moe_lightning.checkpoint_error import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of `model_dir`: its index's shards, else model.safetensors, else every
    *.safetensors there. Raises CheckpointError naming the index or the directory."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
        # shard names are files of this directory: a path would read outside the model
        if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) and f and Path(f).name == f for f in weight_map.values()
        ):
            raise CheckpointError(f"{index}: weight_map must map tensor names to file names in {model_dir}")
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index} names shard {f.name}, which does not exist")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{model_dir}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors found")
    return found
