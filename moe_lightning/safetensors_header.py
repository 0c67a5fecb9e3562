"""Parsing and validating a .safetensors header before any of its tensors is mapped.

A checkpoint is operator input that may be truncated, mislabelled or hand-crafted. Everything the
safetensors library would reject later (deep inside a load, as an untyped error) is rejected here with
a CheckpointError that names the file and the tensor: entries that are not objects, fields of the
wrong type, sizes that do not match dtype x shape, data offsets out of range, overlapping or leaving
gaps, a header longer than the file. Anything this accepts, `safetensors.safe_open` reads.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_lightning.checkpoint_error import CheckpointError

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# safetensors' own limit (MAX_HEADER_SIZE): a larger length field is a corrupt file, not a header to read
MAX_HEADER_BYTES = 100_000_000
_USIZE_MAX = 2**64 - 1  # safetensors parses shapes and offsets as u64; larger values fail there


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # byte offset of the data inside the file
    nbytes: int


def _is_uint(v: object) -> bool:
    # bool is an int subclass in Python, but `true` is not a size in JSON
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _USIZE_MAX


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise CheckpointError(f"key {k!r} appears twice")
        out[k] = v
    return out


def _parse_json(path: Path, raw: bytes) -> dict[str, Any]:
    if not raw.startswith(b"{"):
        raise CheckpointError(f"{path}: corrupt safetensors header: it must be a JSON object starting with '{{'")
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header: {exc}") from None
    # ValueError covers bad JSON, bad UTF-8 and over-long integers; RecursionError, deep nesting
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header: {type(exc).__name__}: {exc}"[:500]) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: not a JSON object")
    return header


def _entry(path: Path, name: str, info: object, data_start: int, size: int) -> TensorEntry:
    """One tensor's entry, checked field by field; `size` is the file's."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(
            f"{where}: entry is {type(info).__name__}, expected an object with dtype, shape, data_offsets"
        )
    raw_dtype = info.get("dtype")
    dtype = SAFETENSORS_DTYPES.get(raw_dtype) if isinstance(raw_dtype, str) else None
    if dtype is None:
        raise CheckpointError(
            f"{where} has unsupported dtype {raw_dtype!r} (supported: {', '.join(SAFETENSORS_DTYPES)})"[:500]
        )
    shape = info.get("shape")
    if not isinstance(shape, list) or not all(_is_uint(s) for s in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers"[:500])
    offsets = info.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} is not [begin, end] of non-negative integers"[:500])
    begin, end = offsets
    if end < begin:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] end before they begin")
    numel = 1
    for s in shape:
        numel *= s
        if numel > _USIZE_MAX:  # what safetensors computes in u64, checked the same way
            raise CheckpointError(f"{where}: shape {shape} has too many elements")
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if end - begin != expected:
        raise CheckpointError(f"{where} spans {end - begin} bytes but shape {shape} needs {expected}")
    if data_start + end > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file: tensor {name!r} ends at byte {data_start + end}, file has {size}"
        )
    return TensorEntry(name, path, dtype, tuple(shape), data_start + begin, end - begin)


def _check_layout(path: Path, entries: dict[str, TensorEntry], data_start: int, size: int) -> None:
    """The tensors' data must tile the data section exactly, as safetensors requires: no tensor
    overlaps another (two names over the same bytes), none leaves a gap, nothing trails the last."""
    cursor, previous = data_start, None
    for e in sorted(entries.values(), key=lambda e: (e.offset, e.offset + e.nbytes, e.name)):
        if e.offset < cursor:
            raise CheckpointError(
                f"{path}: tensor {e.name!r} (bytes {e.offset - data_start}..{e.offset - data_start + e.nbytes} of the "
                f"data) overlaps tensor {previous!r}, which ends at {cursor - data_start}"
            )
        if e.offset > cursor:
            raise CheckpointError(
                f"{path}: tensor {e.name!r} starts at data byte {e.offset - data_start}, leaving a gap after "
                f"{'the header' if previous is None else repr(previous)} (which ends at {cursor - data_start})"
            )
        cursor, previous = e.offset + e.nbytes, e.name
    if cursor != size:
        raise CheckpointError(
            f"{path}: {size - cursor} bytes after the last tensor's data; the header does not describe the whole file"
        )


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Parses and validates one .safetensors header; raises CheckpointError naming the file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", raw)
        if 8 + header_len > size:
            raise CheckpointError(
                f"{path}: truncated safetensors file (header says {header_len} bytes, file has {size})"
            )
        if header_len > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: safetensors header of {header_len} bytes (at most {MAX_HEADER_BYTES})")
        header = _parse_json(path, f.read(header_len))
    data_start = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            if info is not None and not (isinstance(info, dict) and all(isinstance(v, str) for v in info.values())):
                raise CheckpointError(f"{path}: __metadata__ must be an object of strings, got {info!r}"[:500])
            continue
        entries[name] = _entry(path, name, info, data_start, size)
    _check_layout(path, entries, data_start, size)
    return entries
