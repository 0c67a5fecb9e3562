"""What the GPU check leaves in its output folder, within what the device tool brings back: at most 8
files of at most 16 MiB each (64 MiB together), at most 2 folders deep, names of letters, digits,
'.', '_' and '-' only. The check writes two: the report (gpu_check.json, every figure) and one
archive of logs and traces (gpu_check-logs.tar.gz); everything else stays in its private work dir."""

from __future__ import annotations

import json
import os
import re
import tarfile
from pathlib import Path
from typing import Any

REPORT_NAME = "gpu_check.json"
ARCHIVE_NAME = "gpu_check-logs.tar.gz"
MAX_FILES = 8
MAX_DEPTH = 2  # folders below the output folder: OUT/a/b/file comes back, OUT/a/b/c/file does not
MAX_FILE_BYTES = 16 << 20
MAX_TOTAL_BYTES = 64 << 20
NAME = re.compile(r"[A-Za-z0-9._-]+")
# the archive is cut below the per-file limit: the trace goes first when it would not fit
ARCHIVE_BUDGET = 15 << 20


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` whole: a run killed mid-write leaves the previous version, never half a file
    (the temporary name is a legal one, so even a leftover comes back)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_report(out: Path, report: dict[str, Any]) -> Path:
    path = out / REPORT_NAME
    write_atomic(path, json.dumps(report, indent=2, default=str).encode())
    return path


def write_archive(out: Path, folder: Path, work: Path) -> dict[str, Any]:
    """`folder` (log tails, bench JSONs, traces) as one .tar.gz in `out`; built in `work` and moved in
    whole. When it would pass ARCHIVE_BUDGET, the traces (the largest part) are left out and named."""
    files = sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []
    left_out: list[str] = []
    for attempt in ("all", "no traces"):
        members = [p for p in files if attempt == "all" or not p.name.endswith("-trace.json")]
        left_out = sorted(p.name for p in set(files) - set(members))
        tmp = work / (ARCHIVE_NAME + ".part")
        with tarfile.open(tmp, "w:gz") as tar:
            for p in members:
                tar.add(p, arcname=str(Path("gpu_check-logs") / p.relative_to(folder)))
        if tmp.stat().st_size <= ARCHIVE_BUDGET or attempt == "no traces":
            break
    write_atomic(out / ARCHIVE_NAME, tmp.read_bytes())
    tmp.unlink()
    return {"path": str(out / ARCHIVE_NAME), "bytes": (out / ARCHIVE_NAME).stat().st_size, "left_out": left_out}


def out_dir_problems(out: Path) -> list[str]:
    """What in `out` the device tool would not bring back: too many files, too deep, odd names, too
    large. Empty when everything comes back."""
    problems = []
    files = [p for p in out.rglob("*") if p.is_file()]
    if len(files) > MAX_FILES:
        problems.append(f"{len(files)} files (at most {MAX_FILES} come back)")
    for p in out.rglob("*"):
        rel = p.relative_to(out)
        if not all(NAME.fullmatch(part) for part in rel.parts):
            problems.append(f"{rel}: a name of other characters than letters, digits, '.', '_', '-'")
        if p.is_file() and len(rel.parts) - 1 > MAX_DEPTH:
            problems.append(f"{rel}: {len(rel.parts) - 1} folders deep (at most {MAX_DEPTH})")
        if p.is_file() and p.stat().st_size > MAX_FILE_BYTES:
            problems.append(f"{rel}: {p.stat().st_size} bytes (at most {MAX_FILE_BYTES})")
    total = sum(p.stat().st_size for p in files)
    if total > MAX_TOTAL_BYTES:
        problems.append(f"{total} bytes in all (at most {MAX_TOTAL_BYTES})")
    return problems
