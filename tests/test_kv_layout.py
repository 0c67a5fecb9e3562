"""Sliding-window layers' blocks in the paged cache (moe_lightning/kv_layout.py): how layers are grouped,
that blocks behind a window go back to the pool as a sequence grows, that the cache and the batcher's
count agree, and that attention over the freed tables is the attention over whole ones."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.kv_layout import KVLayout
from moe_lightning.spec import ModelSpec
from moe_lightning.stages.attend import plan_batch
from moe_lightning.stages.attention import paged_attention, plan_attention, write_kv

BASE = ModelSpec("MixtralForCausalLM", 32, 16, 6, 4, 2, 8, 2, 1, 400)


def _spec(sliding: tuple[int, ...] | None, window: int | None = 8, layers: int = 6) -> ModelSpec:
    return replace(BASE, num_layers=layers, sliding_window=window, sliding_layers=sliding)


def test_layers_are_grouped_by_window_in_groups_of_one_size() -> None:
    full = KVLayout.of(_spec(None, None), 16)
    assert full.windows == (None,) and full.group_layers == 6 and full.layer_slot == tuple(range(6))
    every = KVLayout.of(_spec(None, 8), 16)  # every layer slides: one group, and it frees too
    assert every.windows == (8,) and every.group_layers == 6
    alternating = KVLayout.of(_spec((0, 2, 4)), 16)  # GPT-OSS
    # the whole-context group first (group 0's table is AttentionMetadata.block_tables: never a freed entry)
    assert alternating.windows == (None, 8) and alternating.group_layers == 3
    assert alternating.layer_group == (1, 0, 1, 0, 1, 0) and alternating.layer_slot == (0, 0, 1, 1, 2, 2)
    uneven = KVLayout.of(_spec((0, 1, 2, 4), layers=6), 16)  # 4 sliding, 2 full: groups of 2
    assert uneven.windows == (None, 8, 8) and uneven.group_layers == 2
    assert uneven.layer_group == (1, 1, 2, 0, 2, 0)


def test_a_block_holds_one_groups_layers() -> None:
    spec = _spec((0, 2, 4))
    assert PagedKVCache.storage_shape(spec, 10, 4) == (3, 10, 4, 2, 8)
    assert PagedKVCache.bytes_per_block(spec, 4, "float32") * 2 == PagedKVCache.bytes_per_block(
        _spec(None, None), 4, "float32"
    )


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_blocks_behind_the_window_go_back_as_a_sequence_grows(block_size: int) -> None:
    spec = _spec((0, 2, 4), window=8)
    layout = KVLayout.of(spec, block_size)
    cache = PagedKVCache(spec, 1000, block_size, shuffle_seed=0)
    rng = random.Random(0)
    start = 0
    for q in [37, 1, 1, 13, *[1] * 200, 64, *[1] * 50]:  # a chunked prompt, decodes, another chunk
        cache.append([7], [q])
        assert cache.blocks_of(7) == layout.blocks_held(start, start + q)  # the batcher's count, exactly
        assert cache.num_free_blocks == 1000 - cache.blocks_of(7)
        start += q
        if rng.random() < 0.1:
            cache.append([8], [rng.randint(1, 20)])  # another sequence taking blocks in between
            cache.free(8)
    full_blocks = -(-start // block_size)
    sliding = cache.blocks_of(7) - full_blocks
    assert sliding <= -(-8 // block_size) + 1  # the window's blocks, not the context's
    assert cache.freed_behind_windows >= full_blocks - sliding
    cache.free(7)
    assert cache.num_free_blocks == 1000 and not cache.tables and not cache.group_tables[0]


@pytest.mark.parametrize("native_kernel", [True, False], ids=["native", "pytorch"])
@pytest.mark.parametrize(("window", "block_size"), [(8, 4), (3, 4), (5, 4), (5, 16)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, "int8"])
def test_attention_over_freed_tables_is_attention_over_whole_ones(
    kv_dtype: torch.dtype | str, window: int, block_size: int, native_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ragged batch of chunks and decodes, each step attended from a cache whose sliding layers freed
    their blocks and from one of the same model without windows in its layout (every layer's block
    kept), the window applied by the plan alone: the same outputs, bit for bit. Windows a multiple of
    the block, not one, and under one; decode by the native kernel and by the PyTorch path (the device's)."""
    from moe_lightning import native

    if not native_kernel:
        monkeypatch.setattr(native, "decode_kernel", lambda: None)
    elif native.decode_kernel() is None:
        pytest.skip("the native kernel did not build here")
    spec = _spec((0, 2), window=window, layers=4)
    gen = torch.Generator().manual_seed(0)
    freeing = PagedKVCache(spec, 600, block_size, kv_dtype, shuffle_seed=1)
    whole = replace(spec, sliding_window=None, sliding_layers=None)
    keeping = PagedKVCache(whole, 300, block_size, kv_dtype, shuffle_seed=2)
    seqs, steps = [0, 1, 2], [[23, 5, 40], [1, 1, 1], [9, 1, 1], *[[1, 1, 1]] * 12, [30, 1, 17]]
    for q_lens in steps:
        meta_f = freeing.append(seqs, q_lens)
        meta_k = keeping.append(seqs, q_lens)
        plans_f = plan_batch(spec, meta_f)
        t = sum(q_lens)
        for layer in range(spec.num_layers):
            q = torch.randn(t, spec.num_heads, spec.head_dim, generator=gen)
            k, v = (torch.randn(t, spec.num_kv_heads, spec.head_dim, generator=gen) for _ in range(2))
            window = spec.window_of(layer)
            plan_k = plan_attention(meta_k, window)
            kc_f, vc_f = freeing.layer(layer)
            write_kv(kc_f, vc_f, k, v, plans_f[layer].write_slots)
            write_kv(keeping.k[layer], keeping.v[layer], k, v, plan_k.write_slots)
            got = paged_attention(q, kc_f, vc_f, plans_f[layer])
            want = paged_attention(q, keeping.k[layer], keeping.v[layer], plan_k)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert freeing.freed_behind_windows > 0
    held_f = sum(freeing.blocks_of(s) for s in seqs) * PagedKVCache.bytes_per_block(spec, block_size, kv_dtype)
    held_k = sum(keeping.blocks_of(s) for s in seqs) * PagedKVCache.bytes_per_block(whole, block_size, kv_dtype)
    # about half the layers keep only their window's blocks (contexts of 30-110 tokens: blocks of 16 keep more)
    assert held_f < (0.75 if block_size == 4 else 0.9) * held_k


def test_the_batch_must_bring_every_groups_tables() -> None:
    spec = _spec((0, 2, 4))
    other = PagedKVCache(_spec(None, None), 20, 4)
    with pytest.raises(ValueError, match="layer groups"):
        plan_batch(spec, other.append([0], [3]))


def test_the_planner_counts_only_the_window_of_sliding_layers() -> None:
    """By need, a GPT-OSS-like model's cache of the same tokens in every layer holds more sequences
    (its sliding half keeps a window's blocks), the more the longer the contexts; reserved, the same."""
    from host_profile import HOST

    from moe_lightning.hrm.layercost import Workload
    from orchestrator.planner import Planner

    windowed = _spec((0, 2, 4), window=64)
    full = _spec(None, None)
    held = {}
    for name, spec in (("windowed", windowed), ("full", full)):
        for rule in ("expected", "max"):
            p = Planner(spec, HOST, Workload(1024, 256), "float32", kv_tokens=200_000, kv_rule=rule, kv_block_size=16)
            held[name, rule] = p.sequences_held(200_000)
    assert held["windowed", "max"] == held["full", "max"]
    assert 1.6 < held["windowed", "expected"] / held["full", "expected"] < 2.0  # (1 + 80/1152) / 2 of the blocks
