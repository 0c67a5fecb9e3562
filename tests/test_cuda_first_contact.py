"""Defects of the CUDA path found by reading, before it ever ran (issue 26, item 2), each tested where
a CPU can show it: a rank's device always names its GPU, the host's quantized kernels are raced only
when experts compute there, int8/int4 dequantize in few large blocks on CUDA (and the HRM models
that scratch), and a benchmark's KV cache is sized from its workload, not a fixed 4 GiB."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from moe_lightning.benchmark import KV_FLOOR_BLOCKS, decode_totals, kv_cache_bytes, mtbench_lengths, run_batch
from moe_lightning.config.stack import StackConfig
from moe_lightning.demo_model import PRESETS, mixtral_config
from moe_lightning.hrm.hardware import load_profile
from moe_lightning.hrm.kernels import expert_kernels
from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.launcher import SERVICES, Stack
from moe_lightning.quant import kernels
from moe_lightning.quant.kernels import dense_linear
from moe_lightning.quant.rtn import quantize
from moe_lightning.quant.scheme import QuantFormat, QuantScheme, dequant_chunk
from moe_lightning.spec import ModelSpec
from moe_lightning.tensor_parallel import Shard
from services.gpu_expert.rank_builder import HOST_WARM_UP_ROWS, claim_device, host_warm_up_rows, rank_device
from services.gpu_expert.residency import plan_residency
from services.gpu_expert.server import build_parser

MIXTRAL_W13, MIXTRAL_W2 = (2 * 14336, 4096), (4096, 14336)  # (out, in) features of one expert's linears


@pytest.fixture(autouse=True)
def fresh_chooser() -> Iterator[None]:
    kernels.configure()
    yield
    kernels.configure()


# --- 1. a rank's device --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("device", "shard", "same", "index"),
    [
        ("cuda", Shard(0, 1), False, 0),  # one rank on plain `cuda`
        ("cuda", Shard(1, 2), False, 1),  # a rank of a group takes its own GPU
        ("cuda", Shard(1, 2), True, 0),  # --tp-same-device: both ranks on one GPU
        ("cuda:1", Shard(0, 1), False, 1),
        ("cuda:1", Shard(1, 2), True, 1),
    ],
)
def test_a_rank_device_always_names_its_gpu(
    device: str, shard: Shard, same: bool, index: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    claimed: list[int] = []
    # torch.cuda.set_device runs as it is (its index check is what refused a bare `cuda`); only the
    # driver call at its end, absent from a CPU build, is recorded instead
    monkeypatch.setattr(torch._C, "_cuda_setDevice", claimed.append, raising=False)
    got = rank_device(device, shard, same)
    assert got == torch.device("cuda", index)
    claim_device(got)
    assert claimed == [index]


def test_a_rank_device_beyond_the_visible_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"rank 1 of 2 needs cuda:2, but 2 CUDA device\(s\)"):
        rank_device("cuda:1", Shard(1, 2))
    with pytest.raises(ValueError, match="this process needs cuda:2"):
        rank_device("cuda:2", Shard(0, 1))
    assert rank_device("cpu", Shard(1, 2)) == torch.device("cpu")  # a CPU's ranks share it, no count


# --- 2. the host's kernels warm up only where experts compute on the host --------------------------
def test_host_kernels_warm_up_only_when_experts_compute_on_the_host() -> None:
    expert, dense = 100, 1000
    streams = plan_residency(4, 8, expert, dense, dense + 20 * expert)  # a ring and a few resident
    assert streams.ring_slots > 0 and sum(map(len, streams.resident)) < 32
    no_ring = plan_residency(4, 8, expert, dense, dense + 20 * expert, stream=False)
    everything = plan_residency(4, 8, expert, dense, dense + 32 * expert)
    assert no_ring.ring_slots == 0 and sum(map(len, everything.resident)) == 32
    # experts stream (or the planner may still choose): nothing raced at start, chosen on first use
    assert host_warm_up_rows("gpu", streams, host_apart=True) == 0
    assert host_warm_up_rows("auto", streams, host_apart=True) == 0
    assert host_warm_up_rows("cpu", streams, host_apart=True) == HOST_WARM_UP_ROWS
    assert host_warm_up_rows("auto", no_ring, host_apart=True) == HOST_WARM_UP_ROWS  # the host is the only place
    assert host_warm_up_rows("cpu", everything, host_apart=True) == 0  # nothing left on the host
    assert host_warm_up_rows("cpu", no_ring, host_apart=False) == 0  # a CPU device: its own kernels


def test_the_stack_tells_gpu_expert_the_experts_placement(tmp_path: Path) -> None:
    stack = Stack(StackConfig(model=tmp_path, experts_placement="cpu"))
    stack.addresses = {name: f"unix:{tmp_path / name}" for name in SERVICES}
    stack.metrics_ports = dict.fromkeys(SERVICES, 0)
    assert build_parser().parse_args(stack._args("gpu_expert")).experts_placement == "cpu"


# --- 3. dequantize-then-GEMM: blocks of 64 Mi weights on CUDA (issue 53: not a whole LM head) ------
def test_cuda_dequantizes_in_blocks_of_256_mib_of_float32_and_a_cpu_keeps_its_blocks() -> None:
    cuda = [math.ceil(n / kernels.dequant_block_rows(n, k, "cuda")) for n, k in (MIXTRAL_W13, MIXTRAL_W2)]
    assert cuda == [2, 1]  # a few launches per expert call, not the CPU's 43 blocks of 4-5 kernels
    blocks = [math.ceil(n / kernels.dequant_block_rows(n, k, "cpu")) for n, k in (MIXTRAL_W13, MIXTRAL_W2)]
    assert blocks == [28, 15]
    for n, k, want in ((129280, 7168, 14), (201088, 2880, 9)):  # DeepSeek-V3's and GPT-OSS-120B's LM heads
        rows = kernels.dequant_block_rows(n, k, "cuda")
        assert math.ceil(n / rows) == want and rows * k * 4 <= 256 << 20
    assert kernels.dequant_block_rows(96, 256, "cpu") == 96  # a small linear is one block anywhere


@pytest.mark.parametrize(
    "scheme", [QuantScheme(QuantFormat.INT8), QuantScheme(QuantFormat.INT4, 32)], ids=lambda s: s.key()
)
def test_the_hrm_counts_the_scratch_the_cuda_kernel_allocates(scheme: QuantScheme) -> None:
    hw = load_profile("t4")
    (dequant,) = [k for k in expert_kernels(hw, scheme, 2, 1.0, on_device=True) if k.name == "dequant_mm"]
    n, k = MIXTRAL_W13
    at_once = kernels.dequant_block_rows(n, k, "cuda") * k  # weights the kernel expands per call
    assert dequant.scratch_bytes(n * k) == dequant.scratch * at_once
    assert dequant.scratch_weights == dequant_chunk("cuda")


def _counting_dequantize(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = kernels._dequantize_rows

    def spy(ql: object, dtype: torch.dtype) -> torch.Tensor:
        calls.append(1)
        return real(ql, dtype)  # type: ignore[arg-type]

    monkeypatch.setattr(kernels, "_dequantize_rows", spy)
    return calls


@pytest.mark.parametrize(
    "scheme", [QuantScheme(QuantFormat.INT8), QuantScheme(QuantFormat.INT4, 32)], ids=lambda s: s.key()
)
def test_one_dequantization_per_linear_on_cuda_same_result(
    scheme: QuantScheme, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a chunk of 10 rows' weights, a CPU runs 10 blocks of a (96, 256) weight; the CUDA decision
    one, whose result is the dense GEMM on the dequantized weights exactly."""
    ql = quantize(torch.randn(96, 256, generator=torch.Generator().manual_seed(0)), scheme)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(1))
    want = dense_linear(x, ql.dequantize())
    monkeypatch.setattr(kernels.scheme, "DEQUANT_CHUNK", 256 * 10)
    calls = _counting_dequantize(monkeypatch)
    cuda_rows = kernels.dequant_block_rows(96, 256, "cuda")
    got = kernels._dequant_mm_blocks(x, ql, cuda_rows)
    assert len(calls) == 1 and torch.equal(got, want)
    calls.clear()
    torch.testing.assert_close(kernels._dequant_mm(x, ql), want, rtol=1e-5, atol=1e-5)  # on this CPU
    assert len(calls) == 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dequant_mm_on_cuda_runs_one_dequantization(monkeypatch: pytest.MonkeyPatch) -> None:
    ql = quantize(torch.randn(*MIXTRAL_W2, generator=torch.Generator().manual_seed(0)), QuantScheme(QuantFormat.INT8))
    ql_cuda = ql.to("cuda")
    x = torch.randn(8, MIXTRAL_W2[1], device="cuda")
    calls = _counting_dequantize(monkeypatch)
    got = kernels._dequant_mm(x, ql_cuda)
    assert len(calls) == 1
    torch.testing.assert_close(got.cpu(), dense_linear(x.cpu(), ql.dequantize()), rtol=1e-4, atol=1e-3)


# --- 4. the KV cache of a benchmark, from its workload -----------------------------------------------
def test_the_gpu_checks_kv_cache_is_sized_from_its_workload() -> None:
    from bench.gpucheck.budget import kv_needed

    spec = ModelSpec.from_hf_config(mixtral_config(PRESETS["mixtral-8x7b-4l"], "bfloat16"))
    lengths, gen = mtbench_lengths(64), 32
    size = kv_cache_bytes(spec, lengths, gen, "bfloat16")
    assert size == kv_needed(spec, 64, gen, "bfloat16")  # the /dev/shm budget counts the same number
    assert size < (1 << 30) // 4  # was 4 GiB
    blocks = PagedKVCache.blocks_in(size, spec, 16, torch.bfloat16, "--kv-cache-memory")  # as cpu_attention
    assert blocks >= sum(-(-(n + gen) // 16) for n in lengths)  # every sequence's admission at once


def test_a_batch_runs_in_one_wave_in_the_kv_cache_sized_for_it(tiny_model: Path) -> None:
    """24 prompts of 40-70 tokens, 8 new each: the cache holds them all (above the floor), so every
    sequence decodes together, gen - 1 decode steps; a smaller cache would take more waves."""
    spec = ModelSpec.from_pretrained(tiny_model)
    g = torch.Generator().manual_seed(2)
    batch = [[1, *torch.randint(3, spec.vocab_size, (39 + 30 * i // 23,), generator=g).tolist()] for i in range(24)]
    gen = 8
    size = kv_cache_bytes(spec, [len(p) for p in batch], gen, "float32")
    assert size > KV_FLOOR_BLOCKS * PagedKVCache.bytes_per_block(spec, 16, torch.float32)
    run = run_batch(tiny_model, batch, gen, "kvsize", threads=1, device="cpu", dtype="float32")
    assert [c.completion_tokens for c in run.done] == [gen] * len(batch)
    assert decode_totals(run).steps == gen - 1
