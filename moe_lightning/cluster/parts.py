"""The job's unit of work and of output: a part, a slice of rows of one input file. A part's output
is one Parquet file named after it, written atomically (a temporary name, then a rename), so a part
is in the output once or not at all: a retry after a failure writes it once, and a re-run skips
what is there (resume). Every row carries its key (`row_key`, "<file index>:<row>") to the end,
where the output is checked against the input: every key once.

Reading goes through pyarrow's filesystems, so an input may be on any filesystem pyarrow knows
(local, S3, GCS, HDFS); every node must see the input and output paths (a shared filesystem)."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.json as pj
import pyarrow.parquet as pq

SUFFIXES = (".parquet", ".jsonl", ".json", ".ndjson")
KEY = "row_key"


@dataclass(frozen=True, slots=True)
class Part:
    file_index: int
    path: str  # as the filesystem names it
    start: int  # first row in the file
    stop: int

    @property
    def name(self) -> str:
        return f"part-{self.file_index:05d}-{self.start:09d}.parquet"

    @property
    def rows(self) -> int:
        return self.stop - self.start


def filesystem(spec: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem a path or URI is on, and the path on it."""
    if "://" in spec:
        return pafs.FileSystem.from_uri(spec)
    return pafs.LocalFileSystem(), os.path.abspath(spec)


def input_files(spec: str) -> tuple[pafs.FileSystem, list[str]]:
    """A file, a directory (its .parquet/.jsonl files) or a glob; sorted, so file indices are stable."""
    fs, path = filesystem(spec)
    if any(c in path for c in "*?["):
        import fnmatch

        base = path[: min(path.index(c) for c in "*?[" if c in path)].rsplit("/", 1)[0] or "/"
        infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
        files = [i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, path)]
    elif fs.get_file_info(path).type == pafs.FileType.Directory:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        files = [i.path for i in infos if i.type == pafs.FileType.File]
    else:
        files = [path]
    files = sorted(f for f in files if f.endswith(SUFFIXES) and not os.path.basename(f).startswith((".", "_")))
    if not files:
        raise ValueError(f"{spec}: no .parquet or .jsonl input there")
    return fs, files


def read_file(fs: pafs.FileSystem, path: str) -> pa.Table:
    with fs.open_input_file(path) as f:
        table = pq.read_table(f) if path.endswith(".parquet") else pj.read_json(f)
    if "prompt" not in table.column_names and "prompt_ids" not in table.column_names:
        raise ValueError(f"{path}: each row needs a 'prompt' (text) or 'prompt_ids' (list of ints) column")
    return table


def row_count(fs: pafs.FileSystem, path: str) -> int:
    if path.endswith(".parquet"):
        with fs.open_input_file(path) as f:
            return pq.ParquetFile(f).metadata.num_rows
    return read_file(fs, path).num_rows


def split(fs: pafs.FileSystem, files: list[str], part_rows: int) -> list[Part]:
    parts = []
    for i, path in enumerate(files):
        n = row_count(fs, path)
        parts += [Part(i, path, s, min(s + part_rows, n)) for s in range(0, n, part_rows)]
    return parts


def part_rows(fs: pafs.FileSystem, part: Part) -> pa.Table:
    """The part's rows with their keys (a node reads its own parts: the driver ships no data)."""
    table = read_file(fs, part.path).slice(part.start, part.rows)
    keys = pa.array([f"{part.file_index}:{part.start + j}" for j in range(part.rows)])
    return (
        table.append_column(KEY, keys)
        if KEY not in table.column_names
        else table.set_column(table.column_names.index(KEY), KEY, keys)
    )


def output_dir(spec: str) -> tuple[pafs.FileSystem, str]:
    fs, path = filesystem(spec)
    fs.create_dir(path, recursive=True)
    return fs, path


def done_parts(fs: pafs.FileSystem, out: str) -> set[str]:
    infos = fs.get_file_info(pafs.FileSelector(out, allow_not_found=True))
    return {Path(i.path).name for i in infos if i.type == pafs.FileType.File and i.path.endswith(".parquet")}


def write_part(fs: pafs.FileSystem, out: str, part: Part, table: pa.Table) -> None:
    """Atomically: a reader (or a resumed run) sees the whole part or none of it."""
    tmp = f"{out}/.{part.name}.{uuid.uuid4().hex}.tmp"
    with fs.open_output_stream(tmp) as f:
        pq.write_table(table, f)
    fs.move(tmp, f"{out}/{part.name}")


def check_output(fs: pafs.FileSystem, out: str, parts: list[Part]) -> dict[str, Any]:
    """Every input row's key in the output exactly once; raises otherwise, naming what is off."""
    want = sum(p.rows for p in parts)
    keys: list[str] = []
    for name in sorted(done_parts(fs, out)):
        with fs.open_input_file(f"{out}/{name}") as f:
            keys += pq.read_table(f, columns=[KEY]).column(KEY).to_pylist()
    unique = len(set(keys))
    if len(keys) != want or unique != want:
        raise RuntimeError(f"the output has {len(keys)} rows ({unique} distinct keys), the input {want}")
    return {"rows": want, "distinct_keys": unique, "parts": len(parts)}
