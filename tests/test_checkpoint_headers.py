"""Malformed safetensors headers (issue 14, item 12): the reader raises CheckpointError naming the file
and tensor, never anything else, and whatever it accepts safetensors reads; a weight store given such
a checkpoint exits 1 naming the file and leaves no segment in /dev/shm."""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from moe_lightning.checkpoint import CheckpointReader
from moe_lightning.checkpoint_error import CheckpointError
from moe_lightning.safetensors_header import SAFETENSORS_DTYPES
from moe_lightning.shm.segment import list_segments

from processes import run_weight_store

ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}


def write(path: Path, header: object, data: bytes, header_len: int | None = None, raw: bytes | None = None) -> None:
    text = raw if raw is not None else json.dumps(header).encode()
    n = len(text) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + text + data)


def split(path: Path) -> tuple[dict[str, Any], bytes]:
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def valid(tensors: list[tuple[str, list[int]]]) -> tuple[dict[str, Any], int]:
    """A correct header for (dtype, shape)s laid out back to back, and its data's length."""
    header: dict[str, Any] = {}
    at = 0
    for i, (dtype, shape) in enumerate(tensors):
        n = ITEMSIZE[dtype]
        for s in shape:
            n *= s
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    return header, at


junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.lists(st.integers(-3, 2**65), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
tensors = st.lists(
    st.tuples(st.sampled_from(sorted(ITEMSIZE)), st.lists(st.integers(0, 4), max_size=3)), min_size=0, max_size=4
)
MUTATIONS = ("none", "entry", "dtype", "shape", "offsets", "shift", "duplicate", "metadata", "data", "length")


@st.composite
def checkpoints(draw: st.DrawFn) -> tuple[bytes, int | None, object, bytes]:
    """(raw header or b"", length field or None, header, data): a valid file with one mutation."""
    if draw(st.integers(0, 9)) == 0:  # arbitrary bytes where the JSON goes
        return draw(st.binary(max_size=64)), draw(st.none() | st.integers(0, 2**64 - 1)), None, b""
    header, size = valid(draw(tensors))
    names = [k for k in header if k != "__metadata__"]
    kind = draw(st.sampled_from(MUTATIONS))
    name = draw(st.sampled_from(names)) if names else None
    length = None
    if kind == "entry" and name:
        header[name] = draw(junk)
    elif kind in ("dtype", "shape", "offsets") and name:
        field = {"offsets": "data_offsets"}.get(kind, kind)
        header[name][field] = draw(junk | st.sampled_from([*SAFETENSORS_DTYPES, "F8_E4M3", "U16"]))
    elif kind == "shift" and name:
        b, e = header[name]["data_offsets"]
        d = draw(st.integers(-8, 8))
        header[name]["data_offsets"] = [max(0, b + d), max(0, e + draw(st.sampled_from([0, d])))]
    elif kind == "duplicate" and name:  # a second name over the same bytes: overlapping data offsets
        header["copy"] = dict(header[name])
    elif kind == "metadata":
        header["__metadata__"] = draw(junk | st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2))
    elif kind == "data":
        size = max(0, size + draw(st.integers(-8, 8)))
    elif kind == "length":
        length = draw(st.integers(0, 2**64 - 1))
    return b"", length, header, bytes(size)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(checkpoints())
def test_malformed_headers_raise_only_checkpoint_error(case: tuple[bytes, int | None, object, bytes]) -> None:
    raw, length, header, data = case
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "model.safetensors"
        write(path, header, data, length, raw or None)
        try:
            reader = CheckpointReader(d)
            shapes = {name: reader.get(name).shape for name in reader.entries}
        except CheckpointError as exc:
            assert str(path) in str(exc)  # the file is named
            return
        # accepted: safetensors itself reads every tensor, with the shape we reported
        with safe_open(str(path), framework="pt") as f:
            assert {k: f.get_tensor(k).shape for k in f.keys()} == shapes  # noqa: SIM118
        for name, shape in shapes.items():
            assert tuple(shape) == reader.entry(name).shape


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        ({"w": 5}, 0, r"tensor 'w': entry is int, expected an object"),
        ({"w": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, 8, r"tensor 'w' has unsupported dtype"),
        ({"w": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, 8, r"tensor 'w': shape '2' is not a list"),
        ({"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, 4, r"tensor 'w': shape \[True\]"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": {"a": 0}}}, 8, r"tensor 'w': data_offsets .* not"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, 8, r"tensor 'w': data_offsets \[8, 0\] end"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8, r"tensor 'w' spans 8 bytes but shape"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 4, r"truncated safetensors file: tensor 'w'"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]},
            },
            8,
            r"tensor 'b' .* overlaps tensor 'a'",
        ),
        (
            {"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}},
            8,
            r"tensor 'w' starts at data byte 4, leaving a gap",
        ),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, 8, r"4 bytes after the last tensor"),
        ({"__metadata__": {"k": 1}}, 0, r"__metadata__ must be an object of strings"),
        ([1, 2], 0, r"corrupt safetensors header"),
    ],
)
def test_each_malformation_names_file_and_tensor(tmp_path: Path, header: object, data: int, message: str) -> None:
    path = tmp_path / "model.safetensors"
    write(path, header, bytes(data))
    with pytest.raises(CheckpointError, match=message) as err:
        CheckpointReader(tmp_path)
    assert str(path) in str(err.value)


def test_header_length_beyond_the_file_and_bad_json(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    write(path, {}, b"", header_len=2**63)
    with pytest.raises(CheckpointError, match=r"truncated safetensors file \(header says 9223372036854775808 bytes"):
        CheckpointReader(tmp_path)
    write(path, None, b"", raw=b"{" * 100_000)  # nesting past the recursion limit
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        CheckpointReader(tmp_path)
    write(path, None, b"", raw=b'{"a": 1, "a": 2}')
    with pytest.raises(CheckpointError, match="key 'a' appears twice"):
        CheckpointReader(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../model.safetensors"}}))
    with pytest.raises(CheckpointError, match="weight_map must map tensor names to file names"):
        CheckpointReader(tmp_path)


def _not_an_object(header: dict[str, Any]) -> None:
    header["model.norm.weight"] = [1, 2, 3]


def _overlapping(header: dict[str, Any]) -> None:  # passed the old checks; safetensors failed later
    norm = header["model.norm.weight"]
    begin = header["model.embed_tokens.weight"]["data_offsets"][0]
    norm["data_offsets"] = [begin, begin + ITEMSIZE[norm["dtype"]] * norm["shape"][0]]  # inside the embedding


@pytest.mark.parametrize("damage", [_not_an_object, _overlapping])
def test_weight_store_on_a_corrupt_header_exits_1_names_the_file_and_leaks_no_segment(
    tiny_model: Path, tmp_path: Path, damage: Callable[[dict[str, Any]], None]
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model, bad)
    f = bad / "model.safetensors"
    header, data = split(f)
    damage(header)
    write(f, header, data)
    run = f"wshdr{os.getpid()}{damage.__name__.strip('_')}"
    r = run_weight_store(bad, run, tmp_path / "w.sock")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "startup_failed" in r.stderr and str(f) in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert list_segments(run) == []
