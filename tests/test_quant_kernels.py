"""The quantized formats and kernels on their own: round to nearest within its error bound, every
kernel usable here equal to the dequantized GEMM (exactly the kernels that compute in the weights'
dtype, within bf16 rounding the others), with an act-order permutation too, and the chooser's
policies, pruning and warm-up."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from moe_lightning.quant import kernel_choice, kernels
from moe_lightning.quant.kernels import QuantizedLinear
from moe_lightning.quant.rtn import pack_int4, quantize
from moe_lightning.quant.scheme import QuantFormat, QuantScheme, parse_quantize

CPU = torch.device("cpu")
SCHEMES = [
    QuantScheme(QuantFormat.INT8),
    QuantScheme(QuantFormat.INT4, 32),
    QuantScheme(QuantFormat.INT4, 128),
    QuantScheme(QuantFormat.INT4, -1),
]


@pytest.fixture(autouse=True)
def fresh_chooser() -> Iterator[None]:
    kernels.configure()
    yield
    kernels.configure()


def weight(n: int = 96, k: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.key())
def test_round_to_nearest_stays_within_half_a_step(scheme: QuantScheme) -> None:
    w = weight()
    ql = quantize(w, scheme)
    err = (ql.dequantize() - w).abs()
    if scheme.format is QuantFormat.INT8:
        step = ql.scales[:, None]  # (N, 1)
    else:
        step = ql.scales.repeat_interleave(w.shape[1] // ql.scales.shape[1], dim=1)  # (N, K)
    assert (err <= step / 2 + 1e-6).all()
    whole_row = scheme.group_size == -1 or scheme.format is QuantFormat.INT8
    assert ql.shape == tuple(w.shape) and ql.group_size == (256 if whole_row else scheme.group_size)


def test_int4_packing_puts_even_columns_in_the_high_nibble() -> None:
    q = torch.tensor([[1, 2, 15, 0]])
    assert pack_int4(q).tolist() == [[0x12, 0xF0]]
    assert kernels.unpack_int4(pack_int4(q)).tolist() == q.tolist()


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.key())
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_every_kernel_equals_the_dequantized_gemm(scheme: QuantScheme, rows: int) -> None:
    ql = quantize(weight(), scheme)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    want = x @ ql.dequantize().T
    tried = []
    for k in kernels.KERNELS:
        if k.format is not scheme.format or not k.usable(CPU):
            continue
        try:
            got = k.fn(x, ql)
        except RuntimeError:  # a shape this kernel does not take (int4mm_cpu: group sizes 32-256)
            assert k.name == "int4mm_cpu" and scheme.group_size == -1
            continue
        tried.append(k.name)
        assert got.shape == want.shape and got.dtype == x.dtype
        tol = 1e-5 if k.exact(x.dtype) else 1e-2  # bf16 activations: ~2^-9 relative per element
        assert (got - want).abs().max() <= tol * want.abs().max(), k.name
    assert "dequant_mm" in tried and len(tried) >= 2


def test_an_act_order_permutation_is_applied_per_row_block() -> None:
    """perm (2, K): the gate rows and the up rows each read the input in their own order."""
    w = weight(64, 128)
    perms = [torch.randperm(128, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    halves = [quantize(w[i * 32 : (i + 1) * 32, perms[i]], QuantScheme(QuantFormat.INT4, 32)) for i in (0, 1)]
    ql = QuantizedLinear(
        QuantFormat.INT4,
        torch.cat([h.qweight for h in halves]),
        torch.cat([h.scales for h in halves]),
        torch.cat([h.zeros for h in halves]),
        torch.stack(perms).to(torch.int32),
    )
    dense = ql.dequantize()
    for i in (0, 1):  # in the model's column order again
        torch.testing.assert_close(dense[i * 32 : (i + 1) * 32, perms[i]], halves[i].dequantize(), rtol=0, atol=0)
    x = torch.randn(7, 128)
    kernels.configure("exact")
    torch.testing.assert_close(ql.matmul(x), x @ dense.T, rtol=1e-5, atol=1e-5)


def test_exact_policy_keeps_only_kernels_in_the_weights_dtype() -> None:
    fastest = {
        k.name for k in kernel_choice.KernelChooser(kernels.KERNELS).candidates(QuantFormat.INT8, CPU, torch.float32)
    }
    exact = {
        k.name
        for k in kernel_choice.KernelChooser(kernels.KERNELS, "exact").candidates(QuantFormat.INT8, CPU, torch.float32)
    }
    assert "int8mm_bf16" in fastest and "int8mm_bf16" not in exact and "dequant_mm" in exact
    in_bf16 = {
        k.name
        for k in kernel_choice.KernelChooser(kernels.KERNELS, "exact").candidates(QuantFormat.INT8, CPU, torch.bfloat16)
    }
    assert in_bf16 == {"dequant_mm"}  # the others round the fp32 scales to bf16: not the dequantized weights
    with pytest.raises(ValueError, match="--expert-kernels must be one of fastest, exact"):
        kernels.configure("quick")
    with pytest.raises(ValueError, match="unknown kernel 'nope'"):
        kernels.configure(only="nope")


def test_warm_up_chooses_every_bucket_once_and_prunes_losers() -> None:
    ql = quantize(weight(64, 128), QuantScheme(QuantFormat.INT4, 32))
    chooser = kernels.configure()
    kernels.warm_up([ql, ql], torch.float32)
    buckets = sorted(r["rows"] for r in chooser.report() if r["format"] == "int4")
    assert buckets == [2**i for i in range(11)]
    for key, choice in chooser.table.items():  # dequant_mm's dense GEMMs were raced too (dense_linear)
        assert choice.kernel.name == min(choice.seconds, key=choice.seconds.__getitem__)
        assert not choice.pruned & set(choice.seconds)  # a pruned kernel is not timed
        half = chooser.table.get((*key[:4], key[4] // 2, *key[5:]))
        quarter = chooser.table.get((*key[:4], key[4] // 4, *key[5:]))
        for name in choice.pruned - (half.pruned if half else frozenset()):  # newly pruned: by the rule
            assert half is not None and quarter is not None
            assert half.seconds[name] > kernel_choice.PRUNE_BEHIND * min(half.seconds.values())
            assert half.seconds[name] >= kernel_choice.GROWS * quarter.seconds[name]
    x = torch.randn(3, 128)
    assert chooser.pick(x, ql) is chooser.table[(str(x.device), ql.format, ql.shape, 32, 4, torch.float32)].kernel


def test_a_kernel_whose_time_is_fixed_is_not_pruned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Far behind at few rows but flat (dequantizing a page costs the same at any rows): it stays a
    candidate, and wins where the others have grown past it. Times are given per kernel and rows,
    so that a loaded machine's scheduling delays cannot decide."""

    def fixed(x: torch.Tensor, ql: QuantizedLinear) -> torch.Tensor:
        return x @ ql.dequantize().T

    def growing(x: torch.Tensor, ql: QuantizedLinear) -> torch.Tensor:
        return x @ ql.dequantize().T

    def timed(fn: kernel_choice.Fn, x: torch.Tensor, ql: QuantizedLinear) -> float:
        fn(x, ql)
        return 0.02 if fn is fixed else 0.0005 * x.shape[0]

    ql = quantize(weight(16, 32), QuantScheme(QuantFormat.INT8))
    fake = (
        kernel_choice.Kernel("fixed", QuantFormat.INT8, fixed),
        kernel_choice.Kernel("growing", QuantFormat.INT8, growing),
    )
    chooser = kernel_choice.KernelChooser(fake)
    monkeypatch.setattr(kernel_choice, "_once", timed)
    winners = {rows: chooser.pick(torch.randn(rows, 32), ql).name for rows in (1, 2, 4, 8, 16, 32, 64, 128)}
    assert winners == {
        1: "growing",
        2: "growing",
        4: "growing",
        8: "growing",
        16: "growing",
        32: "growing",
        64: "fixed",
        128: "fixed",
    }
    assert all(not c.pruned for c in chooser.table.values())


def test_a_kernel_far_behind_on_its_first_call_is_not_raced(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU a first call costs what the next ones do: a kernel that took PRUNE_BEHIND times the
    best on it is called once, keeps that time in the choice, and does not win. The kernels' times
    are given (a clock per kernel), not measured: on a loaded machine one scheduling delay in the fast
    kernel's first call made it look slow and the slow one was raced (CI, stop 26)."""
    calls = {"slow": 0, "fast": 0}

    def slow(x: torch.Tensor, ql: QuantizedLinear) -> torch.Tensor:
        calls["slow"] += 1
        return x @ ql.dequantize().T

    def fast(x: torch.Tensor, ql: QuantizedLinear) -> torch.Tensor:
        calls["fast"] += 1
        return x @ ql.dequantize().T

    seconds = {slow: 0.05, fast: 0.05 / (4 * kernel_choice.PRUNE_BEHIND)}

    def timed(fn: kernel_choice.Fn, x: torch.Tensor, ql: QuantizedLinear) -> float:
        fn(x, ql)
        return seconds[fn]

    ql = quantize(weight(16, 32), QuantScheme(QuantFormat.INT8))
    fake = (kernel_choice.Kernel("slow", QuantFormat.INT8, slow), kernel_choice.Kernel("fast", QuantFormat.INT8, fast))
    chooser = kernel_choice.KernelChooser(fake)
    monkeypatch.setattr(kernel_choice, "_once", timed)
    assert chooser.pick(torch.randn(4, 32), ql).name == "fast"
    assert calls == {"slow": 1, "fast": 1 + kernel_choice.RACE_ROUNDS}
    (choice,) = chooser.table.values()
    assert choice.seconds == {"slow": 0.05, "fast": seconds[fast]} and not choice.pruned


def settling_kernels(
    monkeypatch: pytest.MonkeyPatch, race: dict[str, float], steady: dict[str, float]
) -> tuple[kernel_choice.KernelChooser, dict]:
    """A chooser over two int8 kernels with given times: `race` in the race (evicted weight), `steady` on
    a step's calls; the calls each makes are counted. Given, not measured: a loaded machine must not decide."""
    calls = dict.fromkeys(race, 0)

    def make(name: str) -> kernel_choice.Fn:
        def fn(x: torch.Tensor, ql: QuantizedLinear) -> torch.Tensor:
            calls[name] += 1
            return x @ ql.dequantize().T

        return fn

    fns = {name: make(name) for name in race}
    by_fn = {fn: name for name, fn in fns.items()}

    def timed(fn: kernel_choice.Fn, x: torch.Tensor, ql: QuantizedLinear) -> float:
        fn(x, ql)
        return race[by_fn[fn]]

    def step_call(fn: kernel_choice.Fn, x: torch.Tensor, ql: QuantizedLinear) -> tuple[torch.Tensor, float]:
        return fn(x, ql), steady[by_fn[fn]]

    monkeypatch.setattr(kernel_choice, "_once", timed)
    monkeypatch.setattr(kernel_choice, "_timed_call", step_call)
    monkeypatch.setattr(kernel_choice, "SETTLE_MIN_BYTES", 0)  # these weights are a few hundred bytes
    return kernel_choice.KernelChooser(
        tuple(kernel_choice.Kernel(n, QuantFormat.INT8, f) for n, f in fns.items())
    ), calls


def test_a_near_tie_is_settled_on_the_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """The race's winner by 5 % is the slower one on a step's calls: both run SETTLE_CALLS calls in a
    random order after the race, the faster keeps the bucket, and its gauge and report say so."""
    from prometheus_client import REGISTRY

    chooser, calls = settling_kernels(
        monkeypatch, race={"raced": 1.0, "steady": 1.05}, steady={"raced": 0.002, "steady": 0.001}
    )
    ql = quantize(weight(16, 32), QuantScheme(QuantFormat.INT8))
    x = torch.randn(16, 32)
    want = x @ ql.dequantize().T
    torch.testing.assert_close(chooser.run(x, ql), want)  # the race, then the winner's call, uncounted
    (choice,) = chooser.table.values()
    assert choice.kernel.name == "raced" and choice.settling is not None
    assert [k.name for k in choice.settling.kernels] == ["raced", "steady"] and choice.settling.calls == [0, 0]
    before = dict(calls)
    order = []
    for _ in range(2 * kernel_choice.SETTLE_CALLS):
        torch.testing.assert_close(chooser.run(x, ql), want)
        order.append("raced" if calls["raced"] > before["raced"] + order.count("raced") else "steady")
    assert {n: calls[n] - before[n] for n in calls} == {
        "raced": kernel_choice.SETTLE_CALLS,
        "steady": kernel_choice.SETTLE_CALLS,
    }
    assert order != ["raced", "steady"] * kernel_choice.SETTLE_CALLS  # not in turns
    assert choice.kernel.name == "steady" and choice.settling is None
    assert choice.settled == {"raced": pytest.approx(0.002), "steady": pytest.approx(0.001)}
    (row,) = chooser.report()
    assert row["kernel"] == "steady" and row["settled_ms"] == {"raced": 2.0, "steady": 1.0}

    def gauge(kernel: str) -> float | None:
        labels = {"shape": "16x32", "rows": "16", "kernel": kernel}
        return REGISTRY.get_sample_value("moe_lightning_expert_kernel_seconds", labels)

    assert gauge("steady") == pytest.approx(0.001) and gauge("raced") is None
    chooser.run(x, ql)
    assert calls["steady"] == before["steady"] + kernel_choice.SETTLE_CALLS + 1  # settled: the winner alone


def test_a_clear_winner_is_not_settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner-up more than SETTLE_WITHIN behind in the race is not tried on the calls."""
    chooser, calls = settling_kernels(
        monkeypatch, race={"best": 1.0, "behind": 1.2}, steady={"best": 0.002, "behind": 0.001}
    )
    ql = quantize(weight(16, 32), QuantScheme(QuantFormat.INT8))
    x = torch.randn(8, 32)
    for _ in range(2 * kernel_choice.SETTLE_CALLS + 1):
        chooser.run(x, ql)
    (choice,) = chooser.table.values()
    assert choice.kernel.name == "best" and choice.settling is None and not choice.settled
    assert calls["behind"] == 1 + kernel_choice.RACE_ROUNDS  # in the race, none after it


def test_dense_near_ties_settle_on_real_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real dense kernels of this CPU, every runner-up counted as a near tie: the bucket settles on
    one of the two after their calls, and every call's result is the GEMM's."""
    monkeypatch.setattr(kernel_choice, "SETTLE_WITHIN", float("inf"))
    monkeypatch.setattr(kernel_choice, "SETTLE_MIN_BYTES", 96 * 256 * 4)  # this weight, just
    w, x = weight(96, 256), torch.randn(16, 256)
    for _ in range(2 * kernel_choice.SETTLE_CALLS + 1):
        torch.testing.assert_close(kernels.dense_linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    (choice,) = kernels.chooser().table.values()
    assert choice.settling is None and len(choice.settled) == 2 and choice.kernel.name in choice.settled
    assert choice.settled[choice.kernel.name] == min(choice.settled.values())


def test_a_small_weight_keeps_the_race_winner_from_the_first_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under SETTLE_MIN_BYTES a near tie is not settled: every call of the bucket runs one kernel."""
    monkeypatch.setattr(kernel_choice, "SETTLE_WITHIN", float("inf"))
    w, x = weight(96, 256), torch.randn(16, 256)
    assert w.numel() * 4 < kernel_choice.SETTLE_MIN_BYTES
    first = kernels.dense_linear(x, w)
    for _ in range(2 * kernel_choice.SETTLE_CALLS):
        assert torch.equal(kernels.dense_linear(x, w), first)
    (choice,) = kernels.chooser().table.values()
    assert choice.settling is None and not choice.settled


def test_a_single_kernel_can_be_forced() -> None:
    ql = quantize(weight(), QuantScheme(QuantFormat.INT8))
    chooser = kernels.configure(only="dequant_mm")
    ql.matmul(torch.randn(4, 256))
    assert [r["kernel"] for r in chooser.report() if r["format"] == "int8"] == ["dequant_mm"]


def test_command_line_formats_are_checked() -> None:
    assert parse_quantize("int4", 64) == QuantScheme(QuantFormat.INT4, 64)
    with pytest.raises(ValueError, match="--quantize must be one of none, int8, int4, mxfp4, got 'fp8'"):
        parse_quantize("fp8")
    with pytest.raises(ValueError, match="--quantize-group-size must be one of 32, 64, 128, -1, got 100"):
        parse_quantize("int4", 100)
    with pytest.raises(ValueError, match="group size 128 does not divide the input width 96"):
        QuantScheme(QuantFormat.INT4, 128).groups(96)
    with pytest.raises(ValueError, match="activation order"):
        QuantScheme(QuantFormat.INT8, act_order=True)


@pytest.mark.parametrize("scheme", SCHEMES[:2], ids=lambda s: s.key())
def test_dequantize_then_gemm_in_blocks_of_rows(scheme: QuantScheme, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large weight is dequantized a block of rows at a time (bounded scratch), same result."""
    ql = quantize(weight(), scheme)
    x = torch.randn(6, 256)
    whole = kernels._dequant_mm(x, ql)
    monkeypatch.setattr(kernels.scheme, "DEQUANT_CHUNK", 256 * 10)  # 10 rows per block: 10 blocks of 96
    torch.testing.assert_close(kernels._dequant_mm(x, ql), whole, rtol=1e-5, atol=1e-5)
