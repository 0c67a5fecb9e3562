"""The job's unit of work and of output: a part, a run of consecutive input rows. Ray Data reads the
input (its readers, on the cluster's nodes) and splits it into parts (`split_at_indices`); a part's
blocks go to a node's actor through Ray's object store, never through the driver. A part's output
is one Parquet file named after its first row, written atomically (a temporary name, then a
rename), so a part is in the output once or not at all: a retry after a failure writes it once,
and a re-run skips what is there (resume). Every row carries its key (`row_key`: its index in the
input, files in sorted order and rows in file order) to the end, where the output is checked
against the input: every key once.

Paths go through pyarrow's filesystems, so an input may be on any filesystem pyarrow knows (local,
S3, GCS, HDFS); every node must see the output path (a shared filesystem, docs/cluster.md). On the
local filesystem every file of the output (parts, `_parts.json`, `_job.json`) is written as any
output of ours is (output_files.py: never through a link, never another user's file), in a directory
of ours that others cannot add files to."""

from __future__ import annotations

import itertools
import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from moe_lightning.output_files import make_output_dir, output_file

SUFFIXES = (".parquet", ".jsonl", ".json", ".ndjson")
KEY = "row_key"
PLAN = "_parts.json"  # how the output was split: a resume must split the same way


@dataclass(frozen=True, slots=True)
class Part:
    start: int  # its first row's index in the input
    stop: int

    @property
    def name(self) -> str:
        return f"part-{self.start:012d}.parquet"

    @property
    def rows(self) -> int:
        return self.stop - self.start


def filesystem(spec: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem a path or URI is on, and the path on it."""
    if "://" in spec:
        return pafs.FileSystem.from_uri(spec)
    return pafs.LocalFileSystem(), os.path.abspath(spec)


def input_files(spec: str) -> tuple[pafs.FileSystem, list[str]]:
    """A file, a directory (its .parquet/.jsonl files) or a glob; sorted, so row keys are stable."""
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


def split(fs: pafs.FileSystem, files: list[str], part_rows: int) -> list[tuple[Part, Any]]:
    """Ray Data reads `files` (Parquet, or newline-delimited JSON) and splits the rows into parts of
    `part_rows`: (part, its dataset). Files of one format in a row are one dataset, read in order
    (a union of datasets is not ordered, so a part never spans two of them)."""
    import ray.data

    ray.data.DataContext.get_current().execution_options.preserve_order = True  # row keys are positions
    parts: list[tuple[Part, Any]] = []
    offset = 0
    for parquet, run in itertools.groupby(files, key=lambda f: f.endswith(".parquet")):
        paths = list(run)
        ds = (ray.data.read_parquet if parquet else ray.data.read_json)(paths, filesystem=fs).materialize()
        names = ds.schema().names
        if "prompt" not in names and "prompt_ids" not in names:
            raise ValueError(f"{paths[0]}: each row needs a 'prompt' (text) or 'prompt_ids' (list of ints) column")
        n = ds.count()
        pieces = ds.split_at_indices(list(range(part_rows, n, part_rows))) if n > part_rows else [ds]
        parts += [
            (Part(offset + s, offset + min(s + part_rows, n)), pieces[i]) for i, s in enumerate(range(0, n, part_rows))
        ]
        offset += n
    return parts


def with_keys(tables: list[pa.Table], part: Part) -> pa.Table:
    """A part's blocks as one table, each row with its key."""
    table = pa.concat_tables(tables, promote_options="permissive") if len(tables) != 1 else tables[0]
    if table.num_rows != part.rows:
        raise RuntimeError(f"{part.name}: {table.num_rows} rows arrived, {part.rows} expected")
    keys = pa.array(range(part.start, part.stop), pa.int64())
    if KEY in table.column_names:
        return table.set_column(table.column_names.index(KEY), KEY, keys)
    return table.append_column(KEY, keys)


def check_plan(fs: pafs.FileSystem, out: str, part_rows: int, rows: int) -> None:
    """The first run records how it split the input; a resume that would split it otherwise (another
    --part-rows, another input) would write rows twice: it is refused, saying why."""
    path = f"{out}/{PLAN}"
    want = {"part_rows": part_rows, "rows": rows}
    if fs.get_file_info(path).type == pafs.FileType.File:
        with fs.open_input_stream(path) as f:
            have = json.loads(f.read())
        if have != want:
            raise ValueError(
                f"{out} holds parts of a job split as {have}, this one is {want}: use the same input and "
                "--part-rows to resume it, or another --output"
            )
        return
    write_file(fs, path, lambda f: f.write(json.dumps(want).encode()))


def _local(fs: pafs.FileSystem) -> bool:
    return isinstance(fs, pafs.LocalFileSystem)


def output_dir(spec: str) -> tuple[pafs.FileSystem, str]:
    """The output directory, created if missing; a local one is created (the missing directories,
    mode 0755 less the umask) and checked by output_files' own walk (check_output_dir), not by
    pyarrow's create_dir, which follows links and gives 0777 less the umask (under umask 0 or 0002 a
    directory the job would then refuse). The driver calls this before anything starts, each node
    before it writes a part."""
    fs, path = filesystem(spec)
    if _local(fs):
        make_output_dir(Path(path))
    else:
        fs.create_dir(path, recursive=True)
    return fs, path


def done_parts(fs: pafs.FileSystem, out: str) -> set[str]:
    """The parts in the output. A local symbolic link under a part's name is not one (pyarrow follows
    it): that part is written again, and its write refuses the link, naming it."""
    infos = fs.get_file_info(pafs.FileSelector(out, allow_not_found=True))
    names = {Path(i.path).name for i in infos if i.type == pafs.FileType.File and i.path.endswith(".parquet")}
    if _local(fs):
        names = {n for n in names if not os.path.islink(os.path.join(out, n))}
    return names


def write_file(fs: pafs.FileSystem, path: str, write: Callable[[IO[bytes]], Any]) -> None:
    """Atomically: a reader (or a resumed run) sees the whole file or none of it. Locally through
    output_files (a file of ours there is replaced: a retried part is the same rows again, `_job.json`
    is each run's); elsewhere a temporary name, then a move."""
    if _local(fs):
        with output_file(Path(path), overwrite=True) as f:
            write(f)
        return
    head, name = path.rsplit("/", 1)
    tmp = f"{head}/.{name}.{uuid.uuid4().hex}.tmp"
    with fs.open_output_stream(tmp) as f:
        write(f)
    fs.move(tmp, path)


def write_part(fs: pafs.FileSystem, out: str, part: Part, table: pa.Table) -> None:
    write_file(fs, f"{out}/{part.name}", lambda f: pq.write_table(table, f))


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
