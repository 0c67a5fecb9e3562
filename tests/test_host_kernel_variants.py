"""expert_gemm.cpp built for other CPUs on this one (more flags after -march=native): the AVX2 build
(256-bit vectors, pmaddubsw where VNNI is missing) equal to the GEMM on the dequantized weight as the
native build is, and the build without vectors, whose GEMMs raise (PyTorch's kernels then serve) while
its plain-C++ helpers still work."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import host_kernel_checks as checks
import pytest

from moe_lightning import native


def build_variant(directory: Path, name: str, flags: list[str]) -> ModuleType:
    """expert_gemm.cpp built with more flags after -march=native: the instruction sets of other CPUs."""
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name=f"moe_lightning_expert_gemm_{name}",
        sources=[str(native.EXPERT_SOURCE)],
        extra_cflags=[*native.FLAGS, *flags],
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        verbose=False,
    )


# the instruction sets of other CPUs, as flags after -march=native
VARIANTS = {
    "avx2": ["-mno-avx512f", "-mno-avxvnni"],
    "plain": ["-mno-avx512f", "-mno-avx2", "-mno-avxvnni", "-mno-fma", "-mno-clflushopt"],
}


def has_avx2() -> bool:
    return native.cpu_isa() == "avx2" or native.cpu_isa().startswith("avx512")


@pytest.fixture(scope="module")
def variant_builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModuleType]:
    """The variants this CPU can build, compiled at once (one compiler a core, ~30 s each)."""
    names = [name for name in VARIANTS if name != "avx2" or has_avx2()]
    with ThreadPoolExecutor(len(names)) as pool:
        builds = {n: pool.submit(build_variant, tmp_path_factory.mktemp(n), n, VARIANTS[n]) for n in names}
        return {name: build.result() for name, build in builds.items()}


@pytest.fixture(scope="module")
def avx2_build(variant_builds: dict[str, ModuleType]) -> ModuleType:
    if "avx2" not in variant_builds:
        pytest.skip("this CPU has no AVX2")
    return variant_builds["avx2"]


@pytest.mark.parametrize("shape", checks.SHAPES[1:], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rows", [1, 4, 33])
def test_the_avx2_build_equals_the_dequantized_gemm(avx2_build: ModuleType, shape: tuple[int, int], rows: int) -> None:
    """What a machine with AVX2 alone runs (256-bit vectors, pmaddubsw where VNNI is missing)."""
    assert avx2_build.isa == "avx2"
    checks.check_every_kernel(avx2_build, *shape, rows)


def test_the_avx2_build_rounds_activations_as_documented(avx2_build: ModuleType) -> None:
    checks.check_rounded_activations(avx2_build)


def test_the_avx2_build_over_rows_longer_than_a_chunk(avx2_build: ModuleType) -> None:
    checks.check_long_rows(avx2_build)


def test_the_avx2_build_picks_each_columns_first_maximum(avx2_build: ModuleType) -> None:
    checks.check_argmax_columns(avx2_build)


def test_a_build_without_vectors_raises(variant_builds: dict[str, ModuleType]) -> None:
    plain = variant_builds["plain"]
    assert plain.isa == "none"
    checks.check_evict_keeps_the_bytes(plain)  # by plain clflush, the one every x86-64 CPU has
    checks.check_argmax_columns(plain)  # plain C++: every build has it
    w, x = checks.operands(16, 128, 2)
    with pytest.raises(RuntimeError, match="without AVX2/AVX-512"):
        plain.dense_f32(x, w)
