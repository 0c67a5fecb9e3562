"""MXFP4 expert pages (quant/mxfp4.py): dequantization bit for bit against transformers' own
(convert_moe_packed_tensors, the reference GPT-OSS checkpoints are read with; a test-time reference
only), round to nearest onto the e2m1 grid, every mxfp4 kernel against the dense GEMM on the
dequantized weight, and the scheme's pages."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from moe_lightning.quant import kernel_choice, kernels, mxfp4
from moe_lightning.quant.kernels import QuantizedLinear
from moe_lightning.quant.mxfp4 import dequantize_mxfp4, from_blocks, quantize_mxfp4, to_blocks
from moe_lightning.quant.rtn import quantize
from moe_lightning.quant.scheme import QuantFormat, QuantScheme, parse_quantize, scheme_of

CPU = torch.device("cpu")
MX = QuantScheme(QuantFormat.MXFP4)
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def fresh_chooser() -> Iterator[None]:
    kernels.configure()
    yield
    kernels.configure()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def reference(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' dequantization of (E, N, K/32, 16) blocks, back in our (E, N, K) orientation
    (it returns GPT-OSS's (E, K, N))."""
    return convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit for bit (and NaN where NaN, though neither makes any: e8m0 255 is read as 2^128)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    bits = BITS[got.dtype]
    assert torch.equal(got.contiguous().view(bits)[~nan], want.contiguous().view(bits)[~nan])


def random_page(n: int, k: int, seed: int, lo: int = 100, hi: int = 140) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen(seed))
    s = torch.randint(lo, hi, (n, k // 32), dtype=torch.uint8, generator=gen(seed + 1))
    return q, s


# --- dequantization: transformers' bits -------------------------------------------------------------
def test_the_value_table_is_transformers() -> None:
    assert list(mxfp4.E2M1_VALUES) == FP4_VALUES
    assert [v.is_integer() or v * 2 % 1 == 0 for v in mxfp4.E2M1_VALUES] == [True] * 16
    assert torch.signbit(mxfp4.e2m1_table()[8]) and not torch.signbit(mxfp4.e2m1_table()[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequantize_equals_transformers_on_random_pages(dtype: torch.dtype) -> None:
    e, n, k = 3, 24, 256
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, generator=gen(1))
    scales = torch.randint(0, 256, (e, n, k // 32), dtype=torch.uint8, generator=gen(2))  # 0..255, extremes too
    want = reference(blocks, scales, dtype)
    for j in range(e):
        assert_same_bits(dequantize_mxfp4(from_blocks(blocks[j]), scales[j], dtype), want[j])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_byte_under_every_scale_equals_transformers(dtype: torch.dtype) -> None:
    """All 256 bytes x all 256 scales: 2^-127 (float32 subnormals) through 2^128, fp16's underflow
    and overflow, inf above 252 and 255 read as 2^128 (no NaN: ldexp(0, 128) is 0) alike."""
    blocks = torch.arange(256, dtype=torch.uint8).view(16, 16).repeat(256, 1, 1)  # (256, 16, 16)
    scales = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 16).contiguous()  # scale s on row s
    want = reference(blocks[None], scales[None], dtype)[0]  # (256, 512)
    got = dequantize_mxfp4(from_blocks(blocks), scales, dtype)
    assert_same_bits(got, want)
    if dtype is torch.float32:
        assert torch.isfinite(got[:253]).all()  # up to 6 * 2^125
        assert got[0].abs().min() == 0 and got[0][got[0] != 0].abs().min() == 2.0**-128  # a subnormal, kept
        # bytes 0, 1, 2 under 255: 0 x 2^128 is 0, 0.5 x 2^128 = 2^127 finite, 1.0 x 2^128 overflows
        assert not got.isnan().any() and got[255, :6].tolist() == [0.0, 0.0, 2.0**127, 0.0, float("inf"), 0.0]


def test_nibble_order_and_negative_zero() -> None:
    """Column 2j is byte j's LOW nibble (the published order), and nibble 8 is -0.0."""
    q = torch.tensor([[0x21, 0x8F] + [0] * 14], dtype=torch.uint8)  # (1, 16): one block of 32
    s = torch.tensor([[128]], dtype=torch.uint8)  # 2^1
    w = dequantize_mxfp4(q, s)
    assert w[0, :4].tolist() == [1.0, 2.0, -12.0, -0.0]
    assert torch.signbit(w[0, 3]) and not torch.signbit(w[0, 4])


def test_a_page_with_the_wrong_scales_is_refused() -> None:
    q, s = random_page(4, 64, 0)
    with pytest.raises(ValueError, match=r"needs scales \(4, 2\)"):
        dequantize_mxfp4(q, s[:, :1])
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(q, s.float())


def test_blocks_are_the_page_with_a_reshape() -> None:
    blocks = torch.randint(0, 256, (2, 6, 4, 16), dtype=torch.uint8, generator=gen(3))
    q = from_blocks(blocks)
    assert q.shape == (2, 6, 64) and q.data_ptr() == blocks.data_ptr()  # a view: no copy, no repacking
    assert torch.equal(to_blocks(q), blocks)
    (qw, _, qshape), (sc, _, sshape) = MX.components(6, 128, 1)
    assert (qw, sc) == ("qweight", "scales") and qshape == tuple(q.shape[1:]) and sshape == (6, 4)


# --- quantization ------------------------------------------------------------------------------------
def test_weights_on_the_grid_come_back_exactly() -> None:
    """Any page dequantized and quantized again dequantizes to the same weight (its block maxima land
    on the grid under the scale OCP's rule picks), with finite scales up to 252 and the subnormal ones."""
    q, s = random_page(64, 256, 5, lo=0, hi=253)
    w = dequantize_mxfp4(q, s)
    q2, s2 = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(q2, s2), w)
    # where the block's largest magnitude is 4 or 6 (the rule's own scale), the bytes are the same too
    mags = (torch.stack([q & 7, (q >> 4) & 7], -1).view(64, 8, 32)).amax(-1)  # (N, K/32): codes 6 = 4, 7 = 6
    canonical = (mags >= 6) & (s > 0)
    assert torch.equal(s2[canonical], s[canonical])
    rows = canonical.repeat_interleave(16, dim=1)
    assert torch.equal(q2[rows], q[rows])


def test_round_to_nearest_within_half_a_step_and_saturating() -> None:
    w = torch.randn(48, 512, generator=gen(7)) * torch.logspace(-3, 2, 48)[:, None]
    q, s = quantize_mxfp4(w)
    got = dequantize_mxfp4(q, s)
    scale = mxfp4.scale_table(torch.float32)[s.long()].repeat_interleave(32, dim=1)  # (N, K)
    x = (w / scale).abs()  # in [0, 8): the block max in [4, 8)
    blockmax = x.view(48, 16, 32).amax(-1)
    assert ((blockmax >= 4) & (blockmax < 8)).all()
    step = torch.where(x < 2, 0.5, torch.where(x < 4, 1.0, 2.0))
    bound = torch.where(x <= 6, step / 2, x - 6) * scale  # above 6: clipped to 6
    assert ((got - w).abs() <= bound * (1 + 1e-6)).all()
    assert (got.sign() * w.sign() >= 0).all()


def test_ties_go_to_the_even_mantissa_and_zeros_stay_exact() -> None:
    block = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 4.0, -0.0, 0.0, -0.25] + [0.0] * 20
    q, s = quantize_mxfp4(torch.tensor([block]))
    assert s.tolist() == [[127]]  # max 7: floor(log2 7) - 2 = 0
    got = dequantize_mxfp4(q, s)[0, :12].tolist()
    assert got == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 4.0, -0.0, 0.0, -0.0]
    assert torch.signbit(dequantize_mxfp4(q, s)[0, 9])  # -0.0 keeps its sign
    zq, zs = quantize_mxfp4(torch.zeros(2, 64))
    assert not zq.any() and not zs.any()  # an all-zero block: the smallest scale, zero nibbles


def test_quantize_refuses_bad_widths_and_non_finite_weights() -> None:
    with pytest.raises(ValueError, match="mxfp4 needs an input width that is a multiple of 32, got 48"):
        quantize_mxfp4(torch.randn(4, 48))
    with pytest.raises(ValueError, match="finite"):
        quantize_mxfp4(torch.tensor([[float("inf")] + [0.0] * 31]))
    with pytest.raises(ValueError, match="mxfp4 needs an input width that is a multiple of 32, got 48"):
        quantize(torch.randn(4, 48), MX)


def test_rtn_quantize_makes_an_mxfp4_linear() -> None:
    w = torch.randn(40, 96, generator=gen(9))
    ql = quantize(w.bfloat16(), parse_quantize("mxfp4"))
    q, s = quantize_mxfp4(w.bfloat16())
    assert ql.format is QuantFormat.MXFP4 and torch.equal(ql.qweight, q) and torch.equal(ql.scales, s)
    assert ql.shape == (40, 96) and ql.in_features == 96 and ql.group_size == 32
    assert torch.equal(ql.dequantize(), dequantize_mxfp4(q, s))
    assert ql.rows(8, 16).in_features == 96 and torch.equal(ql.rows(8, 16).dequantize(), ql.dequantize()[8:16])
    rel = ((ql.dequantize() - w).norm() / w.norm()).item()
    assert rel < 0.13  # ~0.11 on a Gaussian weight (docs/quantization.md)


# --- kernels -----------------------------------------------------------------------------------------
def mxfp4_kernels(device: torch.device) -> list[kernel_choice.Kernel]:
    return [k for k in kernels.KERNELS if k.format is QuantFormat.MXFP4 and k.usable(device)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 8, 32, 300])
def test_every_mxfp4_kernel_equals_the_dequantized_gemm(rows: int, dtype: torch.dtype) -> None:
    ql = quantize(torch.randn(96, 256, generator=gen(11)), MX)
    x = torch.randn(rows, 256, generator=gen(rows)).to(dtype)
    want = x.float() @ ql.dequantize().T
    kernels.configure(settle=False)  # the two dense GEMMs below in one order: bit-equal
    found = mxfp4_kernels(CPU)  # every one, raced for this dtype or not: each must be right on any
    assert {k.name for k in found} >= {"dequant_mm", "mxfp4_dequant_mm_bf16", "mxfp4_dequant_mm_fp32"}
    for k in found:
        got = k.fn(x, ql)
        assert got.shape == want.shape and got.dtype == dtype, k.name
        # exact: fp32 GEMM rounding only; bf16 activations or output: ~2^-9 relative per element
        tol = 1e-5 if k.exact(dtype) and dtype is torch.float32 else 1e-2
        assert (got.float() - want).abs().max() <= tol * want.abs().max(), k.name
    by_name = {k.name: k.fn for k in found}
    same = "mxfp4_dequant_mm_bf16" if dtype is torch.bfloat16 else "mxfp4_dequant_mm_fp32"
    assert torch.equal(by_name[same](x, ql), by_name["dequant_mm"](x, ql))  # in x's own dtype: dequant_mm


def test_the_chooser_races_the_mxfp4_kernels_and_exact_keeps_the_exact_ones() -> None:
    ql = quantize(torch.randn(64, 128, generator=gen(12)), MX)

    def names(policy: str, dtype: torch.dtype) -> set[str]:
        return {
            k.name
            for k in kernel_choice.KernelChooser(kernels.KERNELS, policy).candidates(QuantFormat.MXFP4, CPU, dtype)
        }

    # a kernel that is dequant_mm itself in x's dtype is not raced against it
    assert names("fastest", torch.float32) == {"dequant_mm", "mxfp4_dequant_mm_bf16"}
    assert names("exact", torch.float32) == {"dequant_mm"}
    assert names("fastest", torch.bfloat16) == names("exact", torch.bfloat16) == {"dequant_mm", "mxfp4_dequant_mm_fp32"}
    assert names("fastest", torch.float16) == {"dequant_mm", "mxfp4_dequant_mm_bf16", "mxfp4_dequant_mm_fp32"}
    assert names("exact", torch.float16) == {"dequant_mm"}
    fastest = names("fastest", torch.float32)
    chooser = kernels.configure()
    kernels.warm_up([ql], torch.float32, max_rows=64)
    report = [r for r in chooser.report() if r["format"] == "mxfp4"]  # not dequant_mm's dense GEMMs
    assert sorted(r["rows"] for r in report) == [1, 2, 4, 8, 16, 32, 64]
    # both timed where nothing can be pruned yet (no smaller buckets to judge by), the faster kept; a
    # kernel far behind at a bucket may go unraced at the larger ones (on a loaded machine, either)
    assert all(set(r["ms"]) == fastest for r in report if r["rows"] <= 2)
    assert all(set(r["ms"]) <= fastest and r["kernel"] == min(r["ms"], key=r["ms"].get) for r in report)
    x = torch.randn(5, 128)
    torch.testing.assert_close(ql.matmul(x), x @ ql.dequantize().T, rtol=1e-2, atol=1e-2 * 5)


def test_dequantize_then_gemm_in_blocks_of_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    ql = quantize(torch.randn(96, 256, generator=gen(13)), MX)
    x = torch.randn(6, 256)
    whole = kernels._dequant_mm(x, ql)
    monkeypatch.setattr(kernels.scheme, "DEQUANT_CHUNK", 256 * 10)  # 10 rows a block
    assert kernels.dequant_block_rows(96, 256, "cpu") == 10
    torch.testing.assert_close(kernels._dequant_mm(x, ql), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_the_bits_and_the_kernels_are_the_same() -> None:
    cuda = torch.device("cuda")
    q, s = random_page(256, 512, 14, lo=0, hi=256)
    for dtype in DTYPES:
        assert_same_bits(dequantize_mxfp4(q.to(cuda), s.to(cuda), dtype).cpu(), dequantize_mxfp4(q, s, dtype))
    ql = quantize(torch.randn(256, 512, generator=gen(15)), MX).to(cuda)
    x = torch.randn(33, 512, device=cuda)
    want = x.double() @ ql.dequantize().double().T
    for k in mxfp4_kernels(cuda):
        got = k.fn(x, ql)
        assert (got.double() - want).abs().max() <= 1e-2 * want.abs().max(), k.name


# --- the scheme --------------------------------------------------------------------------------------
def test_the_scheme_of_mxfp4_pages() -> None:
    assert MX.components(2880, 2880, 2) == [("qweight", "uint8", (2880, 1440)), ("scales", "uint8", (2880, 90))]
    assert MX.bytes_per_weight(2880, 2) == 0.53125  # 4.25 bits
    assert MX.key() == "mxfp4" and MX.group_size == 32 and MX.groups(2880) == 90
    assert parse_quantize("mxfp4") == parse_quantize("mxfp4", 32) == QuantScheme(QuantFormat.MXFP4, 64) == MX
    assert scheme_of(QuantFormat.MXFP4, (2880, 2880), (90, 90), False) == MX
    with pytest.raises(ValueError, match="mxfp4 needs an input width that is a multiple of 32, got 100"):
        MX.components(64, 100, 1)
    with pytest.raises(ValueError, match="activation order"):
        QuantScheme(QuantFormat.MXFP4, act_order=True)
    ql = QuantizedLinear(QuantFormat.MXFP4, *random_page(8, 64, 16))
    assert ql.shape == (8, 64) and ql.group_size == 32
    assert [name for name, _ in ql.components()] == ["qweight", "scales"]


def test_a_group_size_other_than_the_block_is_refused_for_mxfp4() -> None:
    """mxfp4's scales are one per 32 by its format: a --quantize-group-size that says otherwise is an
    error, not silently ignored; 32 or none is accepted, for a format asked for or resolved from auto."""
    from moe_lightning.config.checks import resolve_expert_scheme
    from moe_lightning.families.gpt_oss import PLAN_PRESETS

    spec = PLAN_PRESETS["gpt-oss-20b"]
    for size in (None, 32):
        assert resolve_expert_scheme(spec, None, "mxfp4", size) == QuantScheme(QuantFormat.MXFP4, 32)
        assert resolve_expert_scheme(spec, None, "auto", size).format is QuantFormat.MXFP4
    for asked in ("mxfp4", "auto"):
        with pytest.raises(ValueError, match="must be 32 or left out, got 64"):
            resolve_expert_scheme(spec, None, asked, 64)
