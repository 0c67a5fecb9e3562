"""GPT-OSS's attention sinks over the paged cache: against transformers' own eager GPT-OSS attention
(the sink logit joins each softmax, then is dropped), on a ragged batch of prefills and decodes, with and
without a sliding window, in every cache format, and with prefills long enough to be cut in chunks."""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import SPEC

from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.stages import attention
from moe_lightning.stages.attention import paged_attention, plan_attention, write_kv


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sinks: torch.Tensor, window: int | None):
    """One sequence, by transformers' eager_attention_forward of GPT-OSS: q (n, H, Hd) for the last n
    positions of keys/values (ctx, K, Hd) -> (n, H * Hd)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    n, h, hd = q.shape
    ctx, kvh, _ = keys.shape
    module = torch.nn.Module()
    module.sinks = torch.nn.Parameter(sinks.clone())
    module.num_key_value_groups = h // kvh
    module.training = False
    qp, kp = torch.arange(ctx - n, ctx)[:, None], torch.arange(ctx)[None, :]
    allowed = kp <= qp
    if window is not None:
        allowed &= qp - kp < window
    mask = torch.zeros(n, ctx).masked_fill(~allowed, float("-inf"))[None, None]
    out, _ = eager_attention_forward(
        module, q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], mask, hd**-0.5
    )
    return out[0].reshape(n, h * hd)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, "int8"])
@pytest.mark.parametrize("chunk_bytes", [None, 64])  # 64: every prefill query its own chunk of scores
def test_sinks_match_transformers_on_a_ragged_batch(
    window: int | None, kv_dtype: torch.dtype | str, chunk_bytes: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if chunk_bytes is not None:
        monkeypatch.setattr(attention, "SINK_SCORE_BYTES", chunk_bytes)
    gen = torch.Generator().manual_seed(1)
    prompt_lens = [5, 1, 13, 8]
    steps = 3
    sinks = torch.randn(SPEC.num_heads, generator=gen) * 2
    cache = PagedKVCache(SPEC, num_blocks=64, block_size=4, dtype=kv_dtype, shuffle_seed=3)
    total = [n + steps for n in prompt_lens]
    k_all = [torch.randn(n, 2, 16, generator=gen) for n in total]
    v_all = [torch.randn(n, 2, 16, generator=gen) for n in total]
    q_all = [torch.randn(n, 8, 16, generator=gen) for n in total]
    seqs = list(range(len(prompt_lens)))
    phases = [(list(prompt_lens), [0] * 4)] + [([1] * 4, [n + s for n in prompt_lens]) for s in range(steps)]
    for q_lens, starts in phases:
        meta = cache.append(seqs, q_lens)
        sl = [slice(s, s + q) for s, q in zip(starts, q_lens, strict=True)]
        plan = plan_attention(meta, window)
        k, v = (torch.cat([t[b][sl[b]] for b in seqs]) for t in (k_all, v_all))
        write_kv(cache.k[0], cache.v[0], k, v, plan.write_slots)
        out = paged_attention(torch.cat([q_all[b][sl[b]] for b in seqs]), cache.k[0], cache.v[0], plan, sinks)
        row = 0
        for b in seqs:
            end = starts[b] + q_lens[b]
            # the reference attends over the K/V the cache holds (rounded, or quantized and back)
            held_k, held_v = _held(k_all[b][:end], kv_dtype), _held(v_all[b][:end], kv_dtype)
            want = reference(q_all[b][starts[b] : end], held_k, held_v, sinks, window)
            got = out[row : row + q_lens[b]]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            row += q_lens[b]


def _held(x: torch.Tensor, kv_dtype: torch.dtype | str) -> torch.Tensor:
    if kv_dtype == "int8":
        values, scales = attention.quantize_int8(x)
        return attention.dequantize_int8(values, scales)
    return x.to(kv_dtype).float()


def test_sinks_take_their_share_of_the_softmax() -> None:
    """A very large sink takes all the weight (the output goes to 0), a very small one none of it (plain
    attention): the sink is a logit in the softmax, not a bias on the scores."""
    gen = torch.Generator().manual_seed(2)
    cache = PagedKVCache(SPEC, num_blocks=8, block_size=4, dtype=torch.float32)
    meta = cache.append([0], [6])
    plan = plan_attention(meta)
    k, v, q = (torch.randn(6, n, 16, generator=gen) for n in (2, 2, 8))
    write_kv(cache.k[0], cache.v[0], k, v, plan.write_slots)
    plain = paged_attention(q, cache.k[0], cache.v[0], plan)
    big = paged_attention(q, cache.k[0], cache.v[0], plan, torch.full((8,), 1e4))
    small = paged_attention(q, cache.k[0], cache.v[0], plan, torch.full((8,), -1e4))
    assert big.abs().max().item() == 0.0
    torch.testing.assert_close(small, plain, rtol=1e-5, atol=1e-6)
