"""The native host GEMMs (moe_lightning/native/expert_gemm.cpp through quant/host_kernels.py): each
equal to the GEMM on the dequantized weight (exactly the fp32 ones, within the int8 activations' rounding
the others) at every tile edge (rows and weight rows that are no multiple of the tiles), group sizes
32/64/128/whole rows; and the chooser without the extension (PyTorch's kernels alone). The builds for
other CPUs' instruction sets: test_host_kernel_variants.py."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
from host_kernel_checks import (
    EXACT,
    INT4,
    INT8,
    INT8_ACTIVATIONS,
    SHAPES,
    check_argmax_columns,
    check_every_kernel,
    check_evict_keeps_the_bytes,
    check_long_rows,
    check_rounded_activations,
    operands,
    rel_error,
)

from moe_lightning import native
from moe_lightning.quant import host_kernels, kernel_choice, kernels
from moe_lightning.quant.rtn import quantize
from moe_lightning.quant.scheme import QuantFormat, QuantScheme

CPU = torch.device("cpu")
ROWS = [1, 3, 5, 16, 33]  # the tiles hold 4-6 rows (AVX-512) or 1-3 (AVX2): edges of every kind

needs_native = pytest.mark.skipif(not host_kernels.available(), reason="the expert GEMM extension is not built here")


@pytest.fixture(autouse=True)
def fresh_chooser() -> Iterator[None]:
    kernels.configure()
    yield
    kernels.configure()


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


@needs_native
def test_fp32_gemms_over_rows_longer_than_a_chunk() -> None:
    ext = host_kernels.extension()
    assert ext is not None
    check_long_rows(ext)


@needs_native
def test_evict_keeps_the_bytes() -> None:
    ext = host_kernels.extension()
    assert ext is not None
    check_evict_keeps_the_bytes(ext)


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
