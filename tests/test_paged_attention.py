"""Paged attention gives the same result whatever the block size and block order."""

from __future__ import annotations

import math

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


def dense_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int | None) -> torch.Tensor:
    """One sequence, no paging: q (n, H, Hd) for the last n positions of keys/values (ctx, K, Hd)."""
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
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, h * hd)


def run_two_phase(block_size: int, shuffle: int | None, window: int | None) -> list[torch.Tensor]:
    """Prefill a ragged batch, then 3 decode steps; returns every attention output."""
    gen = torch.Generator().manual_seed(0)
    prompt_lens = [5, 1, 13, 8]
    cache = PagedKVCache(SPEC, num_blocks=64, block_size=block_size, shuffle_seed=shuffle)
    k_all = [torch.randn(n + 3, 2, 16, generator=gen) for n in prompt_lens]
    v_all = [torch.randn(n + 3, 2, 16, generator=gen) for n in prompt_lens]
    q_all = [torch.randn(n + 3, 8, 16, generator=gen) for n in prompt_lens]
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
        expected = torch.cat(
            [dense_reference(q_all[b][sl[b]], k_all[b][: sl[b].stop], v_all[b][: sl[b].stop], window) for b in seqs]
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        outputs.append(out)
    return outputs


@pytest.mark.parametrize("window", [None, 4])
def test_same_result_for_any_block_size_and_order(window: int | None) -> None:
    base = run_two_phase(16, None, window)
    for block_size, shuffle in [(1, None), (1, 7), (3, 1), (5, 2), (16, 3), (32, 4)]:
        for a, b in zip(base, run_two_phase(block_size, shuffle, window), strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_decode_path_equals_ragged_path() -> None:
    """The batched decode kernel and the per-sequence kernel agree on the same batch."""
    from dataclasses import replace

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
        ragged = plan_attention(replace(decode_meta, q_lens=(1, 1, 1)), window)
        ragged = replace(
            ragged,
            decode_groups=(),
            seq_slots=_ragged(decode_meta, window)[0],
            seq_masks=_ragged(decode_meta, window)[1],
        )
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


def _ragged(meta: AttentionMetadata, window: int | None) -> tuple[tuple, tuple]:
    slots, masks = [], []
    for b, ctx in enumerate(meta.ctx_lens):
        kp = torch.arange(ctx)
        m = kp <= ctx - 1
        if window is not None:
            m &= ctx - 1 - kp < window
        slots.append(meta.context_slots(b))
        masks.append(m[None, :])
    return tuple(slots), tuple(masks)


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
