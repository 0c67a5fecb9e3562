"""Paged attention gives the same result whatever the block size and block order."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from moe_lightning.kv_cache import KVCacheFullError, PagedKVCache
from moe_lightning.spec import ModelSpec
from moe_lightning.stages.attention import AttentionMetadata, paged_attention, plan_attention, write_kv

SPEC = ModelSpec(
    architecture="MixtralForCausalLM",
    hidden_size=64,
    intermediate_size=32,
    num_layers=1,
    num_heads=8,
    num_kv_heads=2,
    head_dim=16,
    num_experts=2,
    top_k=1,
    vocab_size=32,
    dtype="float32",
)


def dense_reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int | None, round_p: torch.dtype | None = None
) -> torch.Tensor:
    """One sequence, no paging: q (n, H, Hd) for the last n positions of keys/values (ctx, K, Hd), in fp32.
    `round_p`: the softmax weights rounded to it before multiplying V, as a 16-bit fused kernel does."""
    n, h, hd = q.shape
    ctx, kvh, _ = keys.shape
    k = keys.repeat_interleave(h // kvh, dim=1)  # (ctx, H, Hd)
    v = values.repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    qp = torch.arange(ctx - n, ctx)[:, None]
    kp = torch.arange(ctx)[None, :]
    allowed = kp <= qp
    if window is not None:
        allowed &= qp - kp < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if round_p is None:
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, h * hd)
    e = (scores - scores.amax(-1, keepdim=True)).exp()
    out = torch.einsum("hqk,khd->qhd", e.to(round_p).float(), v) / e.sum(-1).T[:, :, None]
    return out.reshape(n, h * hd)


def run_two_phase(
    block_size: int,
    shuffle: int | None,
    window: int | None,
    dtype: torch.dtype = torch.float32,
    q_dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Prefill a ragged batch, then 3 decode steps with a cache of `dtype` and queries of `q_dtype`;
    returns every attention output. The reference attends in fp32 over the K/V values the cache holds
    (rounded to its dtype); with q and cache in bf16 it rounds the softmax weights to bf16 for P @ V, as
    the fused bf16 kernel (transformers' reference) does."""
    gen = torch.Generator().manual_seed(0)
    prompt_lens = [5, 1, 13, 8]
    cache = PagedKVCache(SPEC, num_blocks=64, block_size=block_size, dtype=dtype, shuffle_seed=shuffle)
    k_all = [torch.randn(n + 3, 2, 16, generator=gen) for n in prompt_lens]
    v_all = [torch.randn(n + 3, 2, 16, generator=gen) for n in prompt_lens]
    q_all = [torch.randn(n + 3, 8, 16, generator=gen).to(q_dtype) for n in prompt_lens]
    outputs = []
    seqs = list(range(len(prompt_lens)))
    phases = [(list(prompt_lens), [0] * 4)] + [([1] * 4, [n + s for n in prompt_lens]) for s in range(3)]
    for q_lens, starts in phases:
        meta = cache.append(seqs, q_lens)
        sl = [slice(s, s + q) for s, q in zip(starts, q_lens, strict=True)]
        k = torch.cat([k_all[b][sl[b]] for b in seqs])
        v = torch.cat([v_all[b][sl[b]] for b in seqs])
        q = torch.cat([q_all[b][sl[b]] for b in seqs])
        plan = plan_attention(meta, window)
        write_kv(cache.k[0], cache.v[0], k, v, plan.write_slots)
        out = paged_attention(q, cache.k[0], cache.v[0], plan)
        held_k = [x.to(dtype).float() for x in k_all]
        held_v = [x.to(dtype).float() for x in v_all]
        round_p = torch.bfloat16 if q_dtype == dtype == torch.bfloat16 else None
        expected = torch.cat(
            [
                dense_reference(
                    q_all[b][sl[b]].float(), held_k[b][: sl[b].stop], held_v[b][: sl[b].stop], window, round_p
                )
                for b in seqs
            ]
        )
        assert out.dtype == q_dtype  # whatever the cache's
        if q_dtype == torch.float32:
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        else:  # one rounding of the output to q's dtype (a P weight may round the other way: fp32 sum order)
            ulp = 2 * torch.finfo(q_dtype).eps * expected.abs().clamp(min=1)
            assert ((out.float() - expected).abs() <= ulp).all()
            assert (out == expected.to(q_dtype)).float().mean() > 0.9
        outputs.append(out)
    return outputs


@pytest.mark.parametrize("window", [None, 4])
def test_same_result_for_any_block_size_and_order(window: int | None) -> None:
    base = run_two_phase(16, None, window)
    for block_size, shuffle in [(1, None), (1, 7), (3, 1), (5, 2), (16, 3), (32, 4)]:
        for a, b in zip(base, run_two_phase(block_size, shuffle, window), strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 4])
def test_16_bit_cache_attends_in_fp32_over_its_values(dtype: torch.dtype, window: int | None) -> None:
    """Prefill and decode of a ragged GQA batch over a bf16/fp16 cache equal fp32 attention over the
    same rounded K/V (the only rounding is the cache's), for any block size and order."""
    base = run_two_phase(16, None, window, dtype)
    for block_size, shuffle in [(1, 7), (5, 2), (32, 4)]:
        for a, b in zip(base, run_two_phase(block_size, shuffle, window, dtype), strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 4])
def test_16_bit_model_attends_in_fp32_and_answers_in_its_dtype(dtype: torch.dtype, window: int | None) -> None:
    """q in 16 bits (a model computing in bf16/fp16), over a cache of its dtype and over an fp32 one: fp32
    scores and sums (bf16 over bf16: the fused kernel, softmax weights rounded to bf16 for P @ V), the
    output in q's dtype. Other block sizes and orders agree within the output's rounding (a fused kernel
    sums in another order over another grid length)."""
    ulp = 2 * torch.finfo(dtype).eps
    for cache_dtype in (dtype, torch.float32):
        base = run_two_phase(16, None, window, cache_dtype, dtype)
        for a, b in zip(base, run_two_phase(3, 1, window, cache_dtype, dtype), strict=True):
            torch.testing.assert_close(a.float(), b.float(), atol=ulp, rtol=ulp)


def test_write_kv_rounds_to_the_cache_dtype() -> None:
    cache = PagedKVCache(SPEC, num_blocks=8, block_size=4, dtype=torch.bfloat16)
    plan = plan_attention(cache.append([0, 1], [6, 3]))
    k = torch.randn(9, 2, 16, generator=torch.Generator().manual_seed(4))
    write_kv(cache.k[0], cache.v[0], k, -k, plan.write_slots)
    assert torch.equal(cache.k[0].view(-1, 2, 16)[plan.write_slots], k.bfloat16())
    assert torch.equal(cache.v[0].view(-1, 2, 16)[plan.write_slots], -k.bfloat16())


@pytest.mark.parametrize("window", [None, 37])
def test_decode_kernel_equals_the_one_it_replaced(window: int | None) -> None:
    """The block-gather decode kernel over an fp32 cache gives what the per-token-slot kernel with
    sdpa's GQA expansion gave (kept in bench/kv_attention.py as the benchmark's baseline), chunked or not."""
    from moe_lightning.stages import attention

    bench = _bench_module()
    spec = bench.one_layer_spec(16, 4, 64)
    cache, _ = bench.decode_batch(spec, 24, 300, block_size=16)
    meta = cache.append(list(range(24)), [1] * 24)
    q = torch.randn(24, 16, 64, generator=torch.Generator().manual_seed(5))
    old = bench.baseline_decode(q, cache.k[0], cache.v[0], bench.baseline_plan(meta, window))
    new = paged_attention(q, cache.k[0], cache.v[0], plan_attention(meta, window))
    torch.testing.assert_close(new, old, atol=1e-6, rtol=1e-6)
    budget = attention.CHUNK_BYTES["cpu"]
    try:
        attention.CHUNK_BYTES["cpu"] = 1  # a chunk of one sequence
        one = paged_attention(q, cache.k[0], cache.v[0], plan_attention(meta, window))
    finally:
        attention.CHUNK_BYTES["cpu"] = budget
    torch.testing.assert_close(one, old, atol=1e-6, rtol=1e-6)


def _bench_module():  # type: ignore[no-untyped-def]
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "bench" / "kv_attention.py"
    spec = importlib.util.spec_from_file_location("kv_attention_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_path_equals_ragged_path() -> None:
    """The batched decode kernel and the per-sequence kernel agree on the same batch."""
    from dataclasses import replace

    from moe_lightning.stages.attention import _sequence_context

    gen = torch.Generator().manual_seed(1)
    cache = PagedKVCache(SPEC, num_blocks=32, block_size=4, shuffle_seed=5)
    meta = cache.append([0, 1, 2], [9, 3, 17])
    t = meta.num_tokens
    k, v = torch.randn(t, 2, 16, generator=gen), torch.randn(t, 2, 16, generator=gen)
    write_kv(cache.k[0], cache.v[0], k, v, meta.slot_mapping())
    decode_meta = cache.append([0, 1, 2], [1, 1, 1])
    k, v = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    write_kv(cache.k[0], cache.v[0], k, v, decode_meta.slot_mapping())
    q = torch.randn(3, 8, 16, generator=gen)
    for window in (None, 5):
        decode = plan_attention(decode_meta, window)
        assert decode.decode_groups
        seqs = tuple(_sequence_context(decode_meta, b, window, "cpu") for b in range(3))
        ragged = replace(decode, decode_groups=(), sequences=seqs)
        a = paged_attention(q, cache.k[0], cache.v[0], decode)
        b = paged_attention(q, cache.k[0], cache.v[0], ragged)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_decode_groups_bound_the_padding_and_cover_every_sequence() -> None:
    from moe_lightning.stages.attention import PADDING_SLACK, _decode_groups

    ctx = (418, 40, 77, 90, 12, 300, 75, 81, 60, 5)
    groups = _decode_groups(ctx)
    assert sorted(b for g in groups for b in g) == list(range(len(ctx)))
    for g in groups:
        assert max(ctx[b] for b in g) * len(g) <= PADDING_SLACK * sum(ctx[b] for b in g) or len(g) == 1
    assert len(groups) < len(ctx)  # similar lengths share a grid


def test_cache_frees_blocks_and_refuses_when_full() -> None:
    cache = PagedKVCache(SPEC, num_blocks=4, block_size=4)
    cache.append([0], [9])  # 3 blocks
    assert cache.usage() == 0.75
    with pytest.raises(KVCacheFullError, match="needs 2 more blocks, 1 free"):
        cache.append([0, 1], [4, 1])
    assert cache.usage() == 0.75  # all-or-nothing: nothing was taken
    cache.free(0)
    assert cache.usage() == 0.0
    meta = cache.append([1], [16])
    assert meta.ctx_lens == (16,) and len(meta.block_tables[0]) == 4


def test_metadata_rejects_inconsistent_batches() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata(q_lens=(3,), ctx_lens=(9,), block_tables=((0, 1),), block_size=4)
    with pytest.raises(ValueError, match="q_len"):
        AttentionMetadata(q_lens=(0,), ctx_lens=(2,), block_tables=((0,),), block_size=4)


def test_the_native_decode_kernel_is_wanted_only_where_attention_runs_in_fp32() -> None:
    """cpu_attention builds the native kernel only for what attends in fp32 (services/cpu_attention/server.py)."""
    from moe_lightning.stages.attention import attends_in_fp32

    bf16, fp16, fp32, int8 = torch.bfloat16, torch.float16, torch.float32, torch.int8
    assert not attends_in_fp32(bf16, bf16, False, "cpu")  # sdpa's bf16 kernel, transformers' rounding
    assert attends_in_fp32(fp32, fp32, False, "cpu") and attends_in_fp32(fp32, bf16, False, "cpu")
    assert attends_in_fp32(bf16, int8, False, "cpu") and attends_in_fp32(bf16, bf16, True, "cpu")  # int8, sinks
    assert attends_in_fp32(fp16, fp16, False, "cpu") and not attends_in_fp32(fp16, fp16, False, "cuda")
