"""The project's native host kernels, built on the machine that runs them (docs/kv-cache.md, "The
decode kernel").

C++ through PyTorch's extension build (ninja and the system's C++ compiler), compiled for this CPU's
instruction set (`-march=native`: AVX2 on one of our machines, AVX-512 with bf16 and VNNI on another),
into a private directory keyed by the source, torch's version and the CPU's flags, so a machine that
changes CPU (a VM moved to another host) builds anew. The build runs once, on first use or by
`python -m moe_lightning.native` (which `make install` and `make dev` run); a machine where it cannot
build (no compiler) runs the PyTorch path instead, and says so once. MOE_LIGHTNING_NATIVE=0 turns the kernels off.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import structlog

from moe_lightning.private_paths import private_dir

DIR_ENV = "MOE_LIGHTNING_NATIVE_DIR"  # where builds go (default ~/.cache/moe-lightning/native)
OFF_ENV = "MOE_LIGHTNING_NATIVE"  # "0": never build or use them
SOURCE = Path(__file__).with_name("decode_attention.cpp")
EXPERT_SOURCE = Path(__file__).with_name("expert_gemm.cpp")  # the host's expert GEMMs (quant/host_kernels.py)
# -fopenmp: at::parallel_for is inlined from ATen's headers, and runs on one thread without it (the
# library it links is the libgomp torch has loaded already: one OpenMP runtime in the process)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]


MAX_QUERY_HEADS_PER_KV = 16  # the kernel's register tile (decode_attention.cpp's MAX_G)
HEAD_DIM_MULTIPLE = 16  # its vectors: 8 or 16 lanes


def fits_decode_kernel(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes these heads (its TORCH_CHECKs); the PyTorch path runs the rest."""
    group = num_heads // num_kv_heads
    return head_dim % HEAD_DIM_MULTIPLE == 0 and group * num_kv_heads == num_heads and group <= MAX_QUERY_HEADS_PER_KV


def cpu_isa() -> str:
    """The widest vector instruction set this CPU has that the compiler targets with -march=native."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        return "unknown"
    if {"avx512f", "avx512bw"} <= flags:
        extras = [name for name, flag in (("bf16", "avx512_bf16"), ("vnni", "avx512_vnni")) if flag in flags]
        return "+".join(["avx512", *extras])
    return "avx2" if "avx2" in flags else "sse"


def _cpu_flags_key() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def build_dir(source: Path) -> Path:
    import torch

    root = Path(os.environ.get(DIR_ENV) or Path.home() / ".cache" / "moe-lightning" / "native")
    key = hashlib.sha256(source.read_bytes() + " ".join(FLAGS).encode() + torch.__version__.encode()).hexdigest()[:16]
    private_dir(root)  # ours alone: a planted .so there would run in every process that loads it
    return private_dir(root / f"{source.stem}-{key}-{_cpu_flags_key()}")


_UNNEEDED: dict[str, str] = {}  # source -> why this process never uses its extension


def not_needed(source: str, reason: str) -> None:
    """This process never uses the extension built from `source` (cpu_attention over a 16-bit KV cache
    attends in sdpa's 16-bit kernel): `load_extension` then neither builds nor loads it (a build is ~30 s
    of a core, which a bf16 GPU run's start paid for nothing). Before the first load_extension call."""
    _UNNEEDED[source] = reason


@functools.cache
def load_extension(source: str) -> ModuleType | None:
    """The extension built from `source` (a .cpp beside this file), built if it is not yet; None where it
    cannot be, is not needed here or MOE_LIGHTNING_NATIVE=0. Logged once, as `native_kernels
    <stem>=native|pytorch`."""
    log = structlog.get_logger()
    path = Path(__file__).with_name(source)
    if os.environ.get(OFF_ENV, "1") == "0":
        log.info("native_kernels", **{path.stem: "pytorch"}, reason=f"{OFF_ENV}=0")
        return None
    if source in _UNNEEDED:
        log.info("native_kernels", **{path.stem: "pytorch"}, reason=_UNNEEDED[source])
        return None
    t0 = time.perf_counter()
    try:
        from torch.utils import cpp_extension

        module = cpp_extension.load(
            name=f"moe_lightning_{path.stem}",
            sources=[str(path)],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir(path)),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: today's path still runs
        log.warning("native_kernels", **{path.stem: "pytorch"}, reason=f"{type(exc).__name__}: {exc}"[:500])
        return None
    log.info("native_kernels", **{path.stem: "native"}, isa=cpu_isa(), seconds=round(time.perf_counter() - t0, 1))
    return module


def decode_kernel() -> ModuleType | None:
    """The decode attention extension (decode_attention.cpp), or None where it cannot be built."""
    return load_extension(SOURCE.name)


def expert_kernel() -> ModuleType | None:
    """The expert GEMM extension (expert_gemm.cpp), or None where it cannot be built."""
    return load_extension(EXPERT_SOURCE.name)


def build_all() -> tuple[ModuleType | None, ModuleType | None]:
    """(decode_kernel(), expert_kernel()), the two built at once where they are not yet: each build is
    one compiler on one core for ~30 s (`python -m moe_lightning.native`, the test suite's start)."""
    with ThreadPoolExecutor(2) as pool:
        decode, expert = pool.submit(decode_kernel), pool.submit(expert_kernel)
        return decode.result(), expert.result()
