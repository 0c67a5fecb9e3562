"""The int8 host KV cache (`--kv-dtype int8`): int8 values and an fp32 scale per token per KV head.

Quantized on write within half a step of each token-head's absmax / 127; attention dequantizes what it
gathers and otherwise computes exactly as over an fp32 cache holding the dequantized values; the whole
stack serves it, says so, and keeps the fp32 cache's greedy tokens on the end-to-end checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_paged_attention import SPEC, dense_reference

from moe_lightning import kv_format
from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.launcher import Stack
from moe_lightning.shm.segment import Segment
from moe_lightning.spec import ModelSpec
from moe_lightning.stages.attention import Int8KV, dequantize_int8, paged_attention, plan_attention, write_kv

from reference import E2E_PROMPTS

# int8 against an fp32 cache of the same K/V (randn, head dim 16, outputs of O(1)): the worst output element
# measured is 0.015 and |out_int8 - out_fp32| / |out_fp32| of a phase 0.0049-0.0058, over every block size,
# order and window here; twice that keeps a seed change from failing it, while a wrong scale or a stale
# block (errors of O(1)) cannot pass
INT8_ATOL = 3e-2
INT8_REL_L2 = 1.2e-2


def _spread_kv(gen: torch.Generator, n: int) -> torch.Tensor:
    """(n, K, Hd) K or V whose token-heads span four orders of magnitude (and an outlier channel), so a
    per-tensor scale would fail where a per-token-head one must not."""
    x = torch.randn(n, SPEC.num_kv_heads, SPEC.head_dim, generator=gen)
    x *= 10.0 ** torch.randint(-2, 2, (n, SPEC.num_kv_heads, 1), generator=gen)
    x[:, :, 3] *= 8.0
    return x


def test_bytes_per_token_of_each_format() -> None:
    """int8: a byte per value plus a 4-byte scale per token-head, for K and for V, in every layer."""
    assert kv_format.bytes_per_token("int8", 32, 8, 128) == 2 * 32 * 8 * (128 + 4)
    assert kv_format.bytes_per_token("bfloat16", 32, 8, 128) == 2 * 32 * 8 * 256
    assert kv_format.bytes_per_token("float32", 1, 1, 64) == 2 * 256
    spec = ModelSpec(**{**SPEC.to_dict(), "num_layers": 3, "eos_token_ids": tuple(SPEC.eos_token_ids)})
    assert PagedKVCache.bytes_per_block(spec, 16, "int8") == 16 * 2 * 3 * 2 * (16 + 4)
    assert PagedKVCache.bytes_per_block(spec, 16, torch.bfloat16) == PagedKVCache.bytes_per_block(spec, 16, "bfloat16")
    assert PagedKVCache.blocks_in(10_000, spec, 16, "int8", "--kv-cache-memory") == 10_000 // (16 * 2 * 3 * 2 * 20)
    with pytest.raises(ValueError, match="KV format"):
        kv_format.bytes_per_token("fp8", 1, 1, 64)


def test_write_then_read_is_within_half_a_step_of_each_token_heads_absmax() -> None:
    """|x - dequantized| <= absmax / 254 per (token, KV head); all-zero token-heads stay zero."""
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(SPEC, num_blocks=16, block_size=4, dtype="int8", shuffle_seed=3)
    assert isinstance(cache.k, Int8KV) and cache.k.values.dtype == torch.int8
    assert cache.k.scales.shape == (1, 16, 4, SPEC.num_kv_heads) and cache.k.scales.dtype == torch.float32
    meta = cache.append([0, 1], [23, 9])
    k, v = _spread_kv(gen, 32), _spread_kv(gen, 32)
    k[5] = 0.0  # a token whose heads are all zero: scale 0, values 0, no NaN
    slots = meta.slot_mapping()
    write_kv(cache.k[0], cache.v[0], k, v, slots)
    for x, part in ((k, cache.k[0]), (v, cache.v[0])):
        values = part.values.view(-1, SPEC.num_kv_heads, SPEC.head_dim)[slots]
        scales = part.scales.view(-1, SPEC.num_kv_heads)[slots]
        got = dequantize_int8(values, scales)
        absmax = x.abs().amax(-1, keepdim=True)
        assert torch.isfinite(got).all()
        assert ((x - got).abs() <= absmax / 254 * (1 + 1e-5)).all()
        torch.testing.assert_close(scales, absmax[..., 0] / 127)
        assert values.abs().max() == 127  # each token-head's absmax lands on the grid's end
    assert (cache.k[0].values.view(-1, 2, 16)[slots[5]] == 0).all()


def run_int8_vs_fp32(
    block_size: int, shuffle: int | None, window: int | None, q_dtype: torch.dtype = torch.float32
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Prefill a ragged GQA batch (4:1), then 3 decode steps, over an int8 cache and an fp32 one written
    with the same K/V; per phase (int8 output, fp32 output, dense fp32 attention over the dequantized K/V)."""
    gen = torch.Generator().manual_seed(0)
    prompt_lens = [5, 1, 13, 8]
    caches = {
        fmt: PagedKVCache(SPEC, num_blocks=64, block_size=block_size, dtype=fmt, shuffle_seed=shuffle)
        for fmt in ("int8", "float32")
    }
    k_all = [torch.randn(n + 3, 2, 16, generator=gen) for n in prompt_lens]
    v_all = [torch.randn(n + 3, 2, 16, generator=gen) for n in prompt_lens]
    q_all = [torch.randn(n + 3, 8, 16, generator=gen).to(q_dtype) for n in prompt_lens]
    seqs = list(range(len(prompt_lens)))
    phases = [(list(prompt_lens), [0] * 4)] + [([1] * 4, [n + s for n in prompt_lens]) for s in range(3)]
    results = []
    for q_lens, starts in phases:
        sl = [slice(s, s + q) for s, q in zip(starts, q_lens, strict=True)]
        k = torch.cat([k_all[b][sl[b]] for b in seqs])
        v = torch.cat([v_all[b][sl[b]] for b in seqs])
        q = torch.cat([q_all[b][sl[b]] for b in seqs])
        outs = {}
        for fmt, cache in caches.items():
            plan = plan_attention(cache.append(seqs, q_lens), window)
            write_kv(cache.k[0], cache.v[0], k, v, plan.write_slots)
            outs[fmt] = paged_attention(q, cache.k[0], cache.v[0], plan)
        int8 = caches["int8"]
        expected = []
        for b in seqs:  # the int8 cache's own values, read back token by token in position order
            table = torch.tensor(int8.tables[b])
            pos = torch.arange(sl[b].stop)
            slot = table[pos // block_size] * block_size + pos % block_size
            held = [
                dequantize_int8(p.values.view(-1, 2, 16)[slot], p.scales.view(-1, 2)[slot])
                for p in (int8.k[0], int8.v[0])
            ]
            expected.append(dense_reference(q_all[b][sl[b]].float(), held[0], held[1], window))
        results.append((outs["int8"], outs["float32"], torch.cat(expected)))
    return results


@pytest.mark.parametrize("window", [None, 4])
def test_int8_cache_attends_in_fp32_over_its_dequantized_values(window: int | None) -> None:
    """Prefill and decode over an int8 cache equal fp32 attention over the dequantized K/V (the cache's
    rounding is the only one), whatever the block size and order, and stay within INT8_ATOL of the fp32
    cache."""
    base = run_int8_vs_fp32(16, None, window)
    for int8, fp32, expected in base:
        assert int8.dtype == torch.float32
        torch.testing.assert_close(int8, expected, atol=1e-5, rtol=1e-5)
        assert (int8 - fp32).abs().max() <= INT8_ATOL
        assert (int8 - fp32).norm() / fp32.norm() <= INT8_REL_L2
        assert not torch.equal(int8, fp32)  # it did quantize
    for block_size, shuffle in [(1, 7), (3, 1), (5, 2), (32, 4)]:
        for (a, _, _), (b, _, expected) in zip(base, run_int8_vs_fp32(block_size, shuffle, window), strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(b, expected, atol=1e-5, rtol=1e-5)


def test_16_bit_queries_over_an_int8_cache_answer_in_their_dtype() -> None:
    """A bf16 model's q over an int8 cache: attended in fp32 over the dequantized chunk, out in bf16."""
    for int8, _, expected in run_int8_vs_fp32(5, 2, 4, torch.bfloat16):
        assert int8.dtype == torch.bfloat16
        ulp = 2 * torch.finfo(torch.bfloat16).eps * expected.abs().clamp(min=1)
        assert ((int8.float() - expected).abs() <= ulp).all()


def test_int8_storage_lives_in_one_shared_memory_segment() -> None:
    """Values and scales are views into one segment (cpu_attention's), the scales past the values, and
    a cache over it reads back what was written."""
    spec = ModelSpec(**{**SPEC.to_dict(), "num_layers": 2, "eos_token_ids": tuple(SPEC.eos_token_ids)})
    nbytes = PagedKVCache.storage_bytes(spec, 8, 4, "int8")
    assert (
        8 * PagedKVCache.bytes_per_block(spec, 4, "int8")
        <= nbytes
        < 8 * PagedKVCache.bytes_per_block(spec, 4, "int8") + 64
    )
    name = f"kv-int8-test-{torch.randint(1 << 30, ()).item()}"
    with Segment.create(name, nbytes) as seg:
        try:
            k, v = PagedKVCache.storage_in(seg.tensor, spec, 8, 4, "int8")
            assert isinstance(k, Int8KV) and isinstance(v, Int8KV)
            base = seg.bytes().data_ptr()
            for t in (k.values, v.values, k.scales, v.scales):
                assert base <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= base + nbytes
            assert k.scales.data_ptr() >= v.values.data_ptr() + v.values.numel()
            cache = PagedKVCache(spec, 8, 4, "int8", storage=(k, v))
            meta = cache.append([0], [6])
            x = torch.randn(6, 2, 16)
            write_kv(cache.k[1], cache.v[1], x, -x, meta.slot_mapping())
            again = PagedKVCache.storage_in(seg.tensor, spec, 8, 4, "int8")[1][1]  # V of layer 1, mapped anew
            slots = meta.slot_mapping()
            got = dequantize_int8(again.values.view(-1, 2, 16)[slots], again.scales.view(-1, 2)[slots])
            assert ((got + x).abs() <= x.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-5)).all()
            with pytest.raises(ValueError, match="format"):
                PagedKVCache(spec, 8, 4, "float32", storage=(k, v))
        finally:
            seg.unlink()


def test_calibration_measures_over_an_int8_cache() -> None:
    """cpu_attention's warm-up with --kv-dtype int8 times attention over an int8 cache, its rate counted in
    the format's own bytes (values and scales), which the HRM multiplies by (kv_format.bytes_per_token)."""
    from moe_lightning.hrm.calibrate import attention_bandwidth, measure_attention_side

    spec = ModelSpec(**{**SPEC.to_dict(), "num_layers": 2, "eos_token_ids": tuple(SPEC.eos_token_ids)})
    assert attention_bandwidth(spec, batch=2, context=32, repeats=1, dtype="int8") > 0
    assert measure_attention_side(spec, contexts=(32,), kv_dtype="int8").attention_bandwidth > 0


ENGINE_STEPS = 17  # test_exactness's: the prefill's token + 16 decode steps
# measured on test_exactness's checkpoints (block size 4, shuffled): every token the same, logits within
# 0.045 (gqa4_top3) and 0.0045 (mha_top1_window) of max |logit| while the tokens agree
MIN_ENGINE_AGREEMENT = 0.9
MAX_RELATIVE_LOGIT_ERROR = 0.1


@pytest.mark.parametrize("config", ["gqa4_top3", "mha_top1_window"])
def test_in_process_engine_over_an_int8_cache_keeps_the_fp32_caches_tokens(
    config: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The exactness checkpoints (4:1 GQA with head dim 32; MHA with a sliding window shorter than the
    contexts) greedy over an int8 cache against the fp32 cache, the weights fp32 in both."""
    from test_exactness import CONFIGS, PROMPTS

    from moe_lightning.checkpoint import load_model_weights
    from moe_lightning.engine import InProcessEngine
    from moe_lightning.request import GenerationRequest

    from reference import save_hf_mixtral

    model = save_hf_mixtral(tmp_path_factory.mktemp(config), seed=1, **CONFIGS[config])
    spec = ModelSpec.from_pretrained(model)
    weights = load_model_weights(model, spec, progress=False)
    tokens, logits = {}, {}
    for fmt in ("float32", "int8"):
        kept: dict[int, list[torch.Tensor]] = {}

        def keep(step: int, idx: list[int], out: torch.Tensor, kept: dict[int, list[torch.Tensor]] = kept) -> None:
            for i, row in zip(idx, out, strict=True):
                kept.setdefault(i, []).append(row.clone())

        engine = InProcessEngine(spec, weights, block_size=4, kv_shuffle_seed=4, kv_dtype=fmt)
        done, _ = engine.generate(
            [GenerationRequest(p, max_new_tokens=ENGINE_STEPS, ignore_eos=True) for p in PROMPTS], on_logits=keep
        )
        tokens[fmt], logits[fmt] = [d.token_ids for d in done], kept
    same = 0
    for i, (a, b) in enumerate(zip(tokens["int8"], tokens["float32"], strict=True)):
        same += sum(x == y for x, y in zip(a, b, strict=True))
        first = next((s for s, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), ENGINE_STEPS - 1)
        for step in range(first + 1):  # the steps whose inputs are the same in both
            got, want = logits["int8"][i][step], logits["float32"][i][step]
            assert (got - want).abs().max() <= MAX_RELATIVE_LOGIT_ERROR * want.abs().max(), (i, step)
    assert same / (ENGINE_STEPS * len(PROMPTS)) >= MIN_ENGINE_AGREEMENT


STACK_TOKENS = 14  # the session's `reference` fixture: transformers' fp32 greedy tokens, 14 per prompt
# agreement of the int8 stack's greedy tokens with fp32 transformers on the E2E checkpoint: the int8
# cache moves logits by ~1e-3 of their range (docs/kv-cache.md), which flips a near-tied argmax now and
# then; a fault in the path (a wrong scale, a stale block) makes the texts disagree from the first steps
MIN_AGREEMENT = 0.9


def test_int8_stack_serves_and_keeps_fp32_greedy_tokens(
    hf_dir: Path, reference: dict[int, list[int]], make_stack: Callable[..., Stack]
) -> None:
    from moe_lightning.api.common.v1 import common_pb2
    from moe_lightning.api.cpu_attention.v1 import cpu_attention_pb2, cpu_attention_pb2_grpc
    from moe_lightning.service.upstream import open_channel

    stack = make_stack(kv_dtype="int8", kv_cache_memory="8MiB", micro_batch_size=4)
    with GenerationClient(stack.api_address, timeout=300) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=STACK_TOKENS) for p in E2E_PROMPTS])
        meta = c.server_metadata()
    channel = open_channel(stack.addresses["cpu_attention"])
    try:
        described = cpu_attention_pb2_grpc.CpuAttentionStub(channel).Describe(cpu_attention_pb2.DescribeRequest())
    finally:
        channel.close()
    stack.stop()
    assert described.kv_dtype == common_pb2.DTYPE_INT8
    assert meta.kv_cache_dtype == "int8"
    spec = ModelSpec.from_pretrained(hf_dir)
    assert meta.kv_cache_tokens == (8 << 20) // PagedKVCache.bytes_per_block(spec, 16, "int8") * 16
    # a text that stops at EOS sooner or later than the reference's counts its missing tokens as misses
    same = sum(a == b for i, d in enumerate(done) for a, b in zip(d.token_ids, reference[i], strict=False))
    total = sum(max(len(d.token_ids), len(reference[i])) for i, d in enumerate(done))
    assert same / total >= MIN_AGREEMENT, f"{same} of {total} tokens agree"
    assert all(d.token_ids[:3] == reference[i][:3] for i, d in enumerate(done))  # no early divergence
    assert stack.leaked_segments() == []
