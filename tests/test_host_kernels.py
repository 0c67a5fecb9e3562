"""The native host GEMMs (moe_lightning/native/expert_gemm.cpp through quant/host_kernels.py): each
equal to the GEMM on the dequantized weight (exactly the fp32 ones, within the int8 activations' rounding
the others) at every tile edge (rows and weight rows that are no multiple of the tiles), group sizes
32/64/128/whole rows; the AVX2 build and the build without vectors (which raises) on this same CPU; and
the chooser without the extension (PyTorch's kernels alone)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest
import torch

from moe_lightning import native
from moe_lightning.quant import host_kernels, kernel_choice, kernels
from moe_lightning.quant.kernels import QuantizedLinear
from moe_lightning.quant.rtn import quantize
from moe_lightning.quant.scheme import QuantFormat, QuantScheme

CPU = torch.device("cpu")
ROWS = [1, 3, 5, 16, 33]  # the tiles hold 4-6 rows (AVX-512) or 1-3 (AVX2): edges of every kind
SHAPES = [(96, 256), (37, 384), (200, 1024)]  # weight rows no multiple of the tiles' 3-4 either
GROUPS = [32, 64, 128, -1]

needs_native = pytest.mark.skipif(not host_kernels.available(), reason="the expert GEMM extension is not built here")


@pytest.fixture(autouse=True)
def fresh_chooser() -> Iterator[None]:
    kernels.configure()
    yield
    kernels.configure()


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def operands(n: int, k: int, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.02, torch.randn(rows, k, generator=g)


Int8Kernel = Callable[[ModuleType, torch.Tensor, QuantizedLinear], torch.Tensor]
INT8: dict[str, Int8Kernel] = {
    "int8_f32": lambda ext, x, q: ext.int8_f32(x, q.qweight, q.scales),
    "int8_i8": lambda ext, x, q: ext.int8_i8(x, q.qweight, q.scales),
}
INT4: dict[str, Int8Kernel] = {
    "int4_f32": lambda ext, x, q: ext.int4_f32(x, q.qweight, q.scales, q.zeros),
    "int4_i8": lambda ext, x, q: ext.int4_i8(x, q.qweight, q.scales, q.zeros),
}
EXACT = 1e-5  # fp32 activations: the order of the sums alone
INT8_ACTIVATIONS = 1.5e-2  # ~0.7 % of the largest output at these shapes, measured; 2x margin


def check_every_kernel(ext: ModuleType, n: int, k: int, rows: int) -> None:
    w, x = operands(n, k, rows, seed=rows)
    assert rel_error(ext.dense_f32(x, w), x @ w.T) <= EXACT
    q8 = quantize(w, QuantScheme(QuantFormat.INT8))
    want = x @ q8.dequantize().T
    for name, fn in INT8.items():
        tol = EXACT if name.endswith("f32") else INT8_ACTIVATIONS
        assert rel_error(fn(ext, x, q8), want) <= tol, (name, n, k, rows)
    for group in GROUPS:
        q4 = quantize(w, QuantScheme(QuantFormat.INT4, group))
        want = x @ q4.dequantize().T
        for name, fn in INT4.items():
            tol = EXACT if name.endswith("f32") else INT8_ACTIVATIONS
            assert rel_error(fn(ext, x, q4), want) <= tol, (name, group, n, k, rows)


@needs_native
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rows", ROWS)
def test_native_kernels_equal_the_dequantized_gemm(shape: tuple[int, int], rows: int) -> None:
    ext = host_kernels.extension()
    assert ext is not None
    check_every_kernel(ext, *shape, rows)


@needs_native
def test_int8_activations_cost_less_than_a_percent_of_the_output() -> None:
    """The i8 kernels round each 128 columns of a row to 8 bits (scale max|x| / 127): on Gaussian
    activations the output's RMS error is 0.65 % of its RMS, as rounding alone gives; a block scale read
    from the wrong row or block, or int4's zeros applied to the unrounded activations (~2x the error),
    would show here first."""
    ext = host_kernels.extension()
    w, x = operands(512, 1024, 16)
    for fmt, fn in ((QuantFormat.INT8, INT8["int8_i8"]), (QuantFormat.INT4, INT4["int4_i8"])):
        q = quantize(w, QuantScheme(fmt, 128))
        want = x @ q.dequantize().T
        rms = float((fn(ext, x, q) - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
        assert rms < 9e-3, (fmt, rms)


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the i8 kernels see it: each (row, 128 columns) scaled by 127 / max|x|, rounded half to even
    (nearbyint's default mode), and scaled back; a block of zeros stays zeros."""
    blocks = x.reshape(x.shape[0], -1, 128)
    top = blocks.abs().amax(-1, keepdim=True)
    c127 = torch.full_like(top, 127.0)  # tensor / tensor: a scalar divisor is a multiply by its reciprocal
    inv = torch.where(top > 0, c127 / top, torch.zeros_like(top))
    scale = torch.where(top > 0, top / c127, torch.ones_like(top))
    return (torch.round(blocks * inv) * scale).reshape(x.shape)


def check_rounded_activations(ext: ModuleType) -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 4096, generator=g) * 0.02
    x = torch.randn(64, 4096, generator=g) * 3
    x[3, 128:256] = 0.0
    x[7, :5] = 0.0
    # the last 16 rows: every value x * (127 / 3) a hair from an odd k + 1/2, their blocks' max 3. Rounded
    # as the product's fp32 value (k + 1/2 exactly) they go to the even neighbour, k + 1; with the
    # multiply fused into the rounding's add, about half would go to k
    odd = torch.randint(-63, 62, (16, 4096), generator=g) * 2 + 1
    inv = torch.tensor(127.0) / torch.tensor(3.0)
    x[48:] = ((odd + 0.5).double() / inv.double()).float()
    x[48:, ::128] = 3.0
    for fmt, group, fn in ((QuantFormat.INT8, 128, INT8["int8_i8"]), (QuantFormat.INT4, 32, INT4["int4_i8"])):
        q = quantize(w, QuantScheme(fmt, group))
        want = (rounded_activations(x).double() @ q.dequantize().double().T).float()
        assert rel_error(fn(ext, x, q), want) <= 2e-6, fmt  # one activation off by one step: ~1e-4


@needs_native
def test_i8_kernels_equal_the_gemm_on_activations_rounded_per_block() -> None:
    """The i8 kernels' only departure from the exact GEMM is the documented rounding of the activations
    (a vectorised rounding that fused the scaling's multiply into an add rounded some ties the other way)."""
    ext = host_kernels.extension()
    assert ext is not None
    check_rounded_activations(ext)


@needs_native
def test_shapes_a_kernel_does_not_take_raise_and_the_chooser_drops_it() -> None:
    """The i8 kernels need K a multiple of 128 (their activation blocks): elsewhere they raise, and the
    chooser races the rest, as for any kernel a build lacks."""
    w, x = operands(64, 96, 4)
    ql = quantize(w, QuantScheme(QuantFormat.INT8))
    with pytest.raises(RuntimeError, match="multiple of 128 columns"):
        host_kernels.int8_i8(x, ql)
    got = ql.matmul(x)
    (choice,) = [c for key, c in kernels.chooser().table.items() if key[1] is QuantFormat.INT8]
    assert "int8_native_i8" not in choice.seconds and "int8_native_f32" in choice.seconds
    assert rel_error(got, x @ ql.dequantize().T) <= INT8_ACTIVATIONS


@needs_native
def test_native_kernels_race_by_policy_and_dtype() -> None:
    fastest = {
        k.name for k in kernel_choice.KernelChooser(kernels.KERNELS).candidates(QuantFormat.INT4, CPU, torch.float32)
    }
    exact = {
        k.name
        for k in kernel_choice.KernelChooser(kernels.KERNELS, "exact").candidates(QuantFormat.INT4, CPU, torch.float32)
    }
    assert {"int4_native_f32", "int4_native_i8"} <= fastest
    assert "int4_native_f32" in exact and "int4_native_i8" not in exact
    # in bf16 the dequantized weights are rounded to bf16 first, which the fp32 kernels do not do
    in_bf16 = {
        k.name
        for k in kernel_choice.KernelChooser(kernels.KERNELS, "exact").candidates(QuantFormat.INT8, CPU, torch.bfloat16)
    }
    assert in_bf16 == {"dequant_mm"}
    dense = {
        k.name for k in kernel_choice.KernelChooser(kernels.KERNELS).candidates(QuantFormat.NONE, CPU, torch.float32)
    }
    assert dense == {"weight_major", "matmul", "dense_native"}
    dense_bf16 = {
        k.name for k in kernel_choice.KernelChooser(kernels.KERNELS).candidates(QuantFormat.NONE, CPU, torch.bfloat16)
    }
    assert dense_bf16 == {"weight_major", "matmul"}


def check_long_rows(ext: ModuleType) -> None:
    """The fp32-activation GEMMs take K in chunks of 1024 columns once x has more rows than one tile:
    each tile's sums carried across chunks, the last one ragged (K no multiple of the vectors either)."""
    for n, k in ((37, 2500), (16, 2048), (9, 1040)):
        for rows in (1, 7, 33):
            w, x = operands(n, k, rows, seed=k + rows)
            assert rel_error(ext.dense_f32(x, w), x @ w.T) <= EXACT, (n, k, rows)
            q8 = quantize(w, QuantScheme(QuantFormat.INT8))
            assert rel_error(ext.int8_f32(x, q8.qweight, q8.scales), x @ q8.dequantize().T) <= EXACT, (n, k, rows)


@needs_native
def test_fp32_gemms_over_rows_longer_than_a_chunk() -> None:
    ext = host_kernels.extension()
    assert ext is not None
    check_long_rows(ext)


def check_evict_keeps_the_bytes(ext: ModuleType) -> None:
    """Eviction writes lines back and drops them: every value reads the same after it, at any dtype,
    length and start (a view that begins and ends inside a cache line)."""
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (10_000,), dtype=torch.uint8, generator=g)
    for t in (raw, raw[3:1003], torch.randn(37, 129, generator=g), torch.randn(1), raw.view(torch.int8)[:64]):
        before = t.clone()
        ext.evict(t)
        assert torch.equal(t, before)
    ext.evict(torch.empty(0))
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.evict(torch.randn(8, 8).t())


@needs_native
def test_evict_keeps_the_bytes() -> None:
    ext = host_kernels.extension()
    assert ext is not None
    check_evict_keeps_the_bytes(ext)


def check_argmax_columns(ext: ModuleType) -> None:
    """Each column's first maximum, as torch.argmax(dim=0) picks it: at row counts under, at and over a
    thread's run (256), with the maximum repeated in one run and across runs (the first wins), and NaN
    (the first NaN wins over any number)."""
    g = torch.Generator().manual_seed(0)
    for rows in (1, 2, 255, 256, 257, 1000, 32000):
        for cols in (1, 3, 16, 257):
            t = torch.randn(rows, cols, generator=g)
            if rows > 1:
                t[rows - 1, 0] = t[0, 0] = 100.0  # the first row and the last: different runs
            if rows > 600:
                t[500, cols - 1] = t[510, cols - 1] = 100.0  # within a run
            assert torch.equal(ext.argmax_columns(t), t.argmax(dim=0)), (rows, cols)
    t = torch.randn(1000, 4, generator=g)
    t[700, 1] = t[900, 1] = t[300, 2] = float("nan")
    t[0, 2] = float("inf")
    got = ext.argmax_columns(t)
    assert torch.equal(got, t.argmax(dim=0)) and got[1] == 700 and got[2] == 300
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.argmax_columns(torch.randn(8, 4).T)
    with pytest.raises(RuntimeError, match="R > 0"):
        ext.argmax_columns(torch.randn(0, 4))


@needs_native
def test_argmax_columns_picks_each_columns_first_maximum() -> None:
    check_argmax_columns(host_kernels.extension())


@needs_native
def test_the_race_times_each_call_over_an_evicted_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step reads each host weight from DRAM (docs/quantization.md, "Kernels"): before every
    timed call of the race, first calls included, the weight's tensors (an int4 page's scales and zeros
    too) are evicted from the caches."""
    evicted: list[list[int]] = []
    real = host_kernels.evict

    def watch(tensors: list[torch.Tensor]) -> bool:
        evicted.append([t.data_ptr() for t in tensors])
        return real(tensors)

    monkeypatch.setattr(host_kernels, "evict", watch)
    w, x = operands(64, 256, 16)
    q4 = quantize(w, QuantScheme(QuantFormat.INT4, 64))
    kernels.chooser().pick(x, q4)
    choice = next(iter(kernels.chooser().table.values()))
    timed = len(choice.seconds)  # every candidate was called at least once, each time evicted first
    assert len(evicted) >= timed >= 2
    page = [q4.qweight.data_ptr(), q4.scales.data_ptr(), q4.zeros.data_ptr()]
    assert evicted.count(page) >= timed, evicted  # (a kernel that dequantizes to a dense GEMM races that too)
    evicted.clear()
    dense, _ = operands(48, 256, 1)  # a shape not raced yet (dequant_mm raced its dense GEMM of w's)
    kernels.chooser().pick(x, dense)
    assert len(evicted) >= 2 and all(ptrs == [dense.data_ptr()] for ptrs in evicted)


@pytest.mark.parametrize("rows", [1, 7, 64, 127, 128, 256, 300])
def test_dense_linear_races_below_the_threshold_and_equals_the_gemm(rows: int) -> None:
    w, x = operands(48, 256, rows)
    got = kernels.dense_linear(x, w)
    torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-5)
    raced = [r for r in kernels.chooser().report() if r["format"] == "none"]
    if rows < kernels.DENSE_RACE_BELOW:
        assert [r["rows"] for r in raced] == [kernel_choice.rows_bucket(rows)] and raced[0]["kernel"] in raced[0]["ms"]
    else:
        assert raced == []  # BLAS's own x @ W^T, not raced


def test_warm_up_races_dense_weights_below_the_threshold_only() -> None:
    w, _ = operands(48, 256, 1)
    ql = quantize(w, QuantScheme(QuantFormat.INT8))
    kernels.warm_up([w, w.clone(), ql], torch.float32)
    buckets: dict[str, list[int]] = {}
    for r in kernels.chooser().report():
        buckets.setdefault(r["format"], []).append(r["rows"])
    assert sorted(buckets["none"]) == [1, 2, 4, 8, 16, 32, 64, 128, 256]  # a decode batch's rows, at most 256
    assert sorted(buckets["int8"]) == [2**i for i in range(11)]


def test_without_the_extension_pytorch_kernels_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the extension cannot build (no compiler, MOE_LIGHTNING_NATIVE=0), its kernels are not
    candidates and every format still has PyTorch's."""
    monkeypatch.setattr(host_kernels, "extension", lambda: None)
    w, x = operands(64, 256, 5)
    for scheme in (QuantScheme(QuantFormat.INT8), QuantScheme(QuantFormat.INT4, 32)):
        names = {
            k.name for k in kernel_choice.KernelChooser(kernels.KERNELS).candidates(scheme.format, CPU, torch.float32)
        }
        assert names and not any("native" in name for name in names)
        ql = quantize(w, scheme)
        assert rel_error(ql.matmul(x), x @ ql.dequantize().T) <= INT8_ACTIVATIONS
    assert rel_error(kernels.dense_linear(x, w), x @ w.T) <= EXACT
    assert "dense_native" not in {r["kernel"] for r in kernels.chooser().report()}
    with pytest.raises(NotImplementedError, match="not built"):
        host_kernels.int4_f32(x, quantize(w, QuantScheme(QuantFormat.INT4, 32)))


def test_a_failed_build_is_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader answers None (and logs why) when the compiler fails: the PyTorch path then serves."""
    from torch.utils import cpp_extension

    def fail(**_: object) -> ModuleType:
        raise RuntimeError("Error building extension: no compiler")

    monkeypatch.setattr(cpp_extension, "load", fail)
    assert native.load_extension.__wrapped__(native.EXPERT_SOURCE.name) is None


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


@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rows", [1, 4, 33])
def test_the_avx2_build_equals_the_dequantized_gemm(avx2_build: ModuleType, shape: tuple[int, int], rows: int) -> None:
    """What a machine with AVX2 alone runs (256-bit vectors, pmaddubsw where VNNI is missing)."""
    assert avx2_build.isa == "avx2"
    check_every_kernel(avx2_build, *shape, rows)


def test_the_avx2_build_rounds_activations_as_documented(avx2_build: ModuleType) -> None:
    check_rounded_activations(avx2_build)


def test_the_avx2_build_over_rows_longer_than_a_chunk(avx2_build: ModuleType) -> None:
    check_long_rows(avx2_build)


def test_the_avx2_build_picks_each_columns_first_maximum(avx2_build: ModuleType) -> None:
    check_argmax_columns(avx2_build)


def test_a_build_without_vectors_raises(variant_builds: dict[str, ModuleType]) -> None:
    plain = variant_builds["plain"]
    assert plain.isa == "none"
    check_evict_keeps_the_bytes(plain)  # by plain clflush, the one every x86-64 CPU has
    check_argmax_columns(plain)  # plain C++: every build has it
    w, x = operands(16, 128, 2)
    with pytest.raises(RuntimeError, match="without AVX2/AVX-512"):
        plain.dense_f32(x, w)


@needs_native
def test_a_long_native_gemm_lets_the_other_threads_run() -> None:
    """The GIL is released for the call, as PyTorch's operators release it: a service's heartbeat thread
    keeps stamping its shared-memory channels beside a long GEMM (a prefill's), or the peer judges the
    service dead (moe_lightning/shm/channel.py)."""
    import threading
    import time

    ext = host_kernels.extension()
    assert ext is not None
    w, x = operands(8192, 4096, 127)
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    thread = threading.Thread(target=tick)
    thread.start()
    try:
        time.sleep(0.01)
        t0 = time.perf_counter()
        ext.dense_f32(x, w)  # ~8.5 GFLOP: tens of milliseconds at least
        t1 = time.perf_counter()
    finally:
        stop.set()
        thread.join()
    assert t1 - t0 > 0.01
    assert sum(t0 < t < t1 for t in ticks) >= 2
