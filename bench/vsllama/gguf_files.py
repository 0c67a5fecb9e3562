"""The checkpoint as llama.cpp reads it: f32, q8_0 and q4_0 GGUF files made by llama.cpp's own tools.

The converter (convert_hf_to_gguf.py, its `conversion` package and the `gguf` package of the same
llama.cpp) is in llama-cpp-python's source distribution, not in what pip installs; it is taken from the
sdist of the installed version, fetched once with pip (`pip download`) into a cache. The f32 file is the
converter's; q8_0 and q4_0 are llama.cpp's quantization of it (llama_model_quantize, in a subprocess).
Files are made once and kept beside the checkpoint, remade when the checkpoint is newer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib import metadata
from pathlib import Path

from bench.vsllama import log

REPO = Path(__file__).resolve().parents[2]
VENDORED = "vendor/llama.cpp/"
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moe-lightning" / "llama-cpp-converter"


def llama_cpp_version() -> str:
    return metadata.version("llama-cpp-python")


def _converter_member(name: str) -> str | None:
    """The path under the converter directory of an sdist member it needs (None: not needed)."""
    _, _, inner = name.partition("/")  # llama_cpp_python-X.Y.Z/...
    if not inner.startswith(VENDORED):
        return None
    rel = inner[len(VENDORED) :]
    return rel if any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in CONVERTER_PARTS) else None


def extract_converter(sdist: Path, target: Path) -> None:
    """The converter's files out of llama-cpp-python's sdist into `target` (regular files only)."""
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            rel = _converter_member(member.name)
            if rel is None or not member.isfile() or ".." in Path(rel).parts:
                continue
            path = target / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None
            with source, path.open("wb") as out:
                shutil.copyfileobj(source, out)
    if not (target / "convert_hf_to_gguf.py").is_file():
        raise RuntimeError(f"{sdist.name} holds no {VENDORED}convert_hf_to_gguf.py")


def converter_dir(cache: Path = CACHE, version: str | None = None) -> Path:
    """A directory holding the converter of llama-cpp-python `version` (default: the installed one)."""
    version = version or llama_cpp_version()
    target = cache / version
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    log(f"fetching llama-cpp-python {version}'s source with pip for its converter...")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*pip, f"llama-cpp-python=={version}", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        staged = Path(tmp) / "converter"
        extract_converter(sdist, staged)
        staged.rename(target)  # whole or not at all: a run cut short leaves no half converter
    return target


def _fresh(path: Path, model: Path) -> bool:
    return path.is_file() and path.stat().st_mtime >= max(f.stat().st_mtime for f in model.glob("*.safetensors"))


def _run(cmd: list[str], what: str) -> None:
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{what} failed ({r.returncode}):\n{r.stderr[-4000:]}")
    log(f"{what}: {time.monotonic() - t0:.0f} s")


def gguf_files(model: Path, types: set[str], out_dir: Path, converter: Path | None, threads: int) -> dict[str, Path]:
    """{type: GGUF path} for each of `types` (f32, q8_0, q4_0), made where missing or stale."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {t: out_dir / f"{model.name}-{t}.gguf" for t in types | {"f32"}}
    f32 = files["f32"]
    if not _fresh(f32, model):
        tool = converter or converter_dir()
        part = f32.with_suffix(".part")
        cmd = [sys.executable, "-m", "bench.vsllama.convert_hf", str(tool), str(model), "--outtype", "f32"]
        _run([*cmd, "--outfile", str(part)], f"convert_hf_to_gguf.py {model.name} -> f32")
        part.rename(f32)
    for kind in sorted(types - {"f32"}):
        path = files[kind]
        if _fresh(path, model) and path.stat().st_mtime >= f32.stat().st_mtime:
            continue
        part = path.with_suffix(".part")
        cmd = [sys.executable, "-m", "bench.vsllama.llama_worker", "quantize", str(f32), str(part), kind]
        _run([*cmd, "--threads", str(threads)], f"llama_model_quantize {model.name} -> {kind}")
        part.rename(path)
    return {t: files[t] for t in types}
