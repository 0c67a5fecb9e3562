"""MLA (DeepSeek-V3's multi-head latent attention) stages against transformers' DeepseekV3Attention: a
ragged prefill, a chunked prefill continuation and decode steps through a paged latent cache with shuffled
block tables, with q LoRA or a full q_proj, interleaved or half-split RoPE, default RoPE or YaRN."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from moe_lightning.spec import ModelSpec
from moe_lightning.stages import attention
from moe_lightning.stages.attention import AttentionMetadata, plan_attention
from moe_lightning.stages.linear import linear
from moe_lightning.stages.mla import (
    MlaShape,
    MlaWeights,
    RopeFn,
    mla_output,
    mla_paged_attention,
    mla_pre_attention,
    mla_shape,
    mla_weights_from_hf,
    rope_interleaved,
    write_latent,
)
from moe_lightning.stages.rope import apply_rope

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
BLOCK_SIZE = 4
# per sequence: a first prefill chunk, its continuation (q_len < ctx_len), then DECODE_STEPS single tokens;
# sequence 0 runs past YaRN's original 64 positions, sequences 2 and 3 are alike enough to share a decode group
CHUNKS = [(40, 30), (4, 2), (9, 8), (10, 6)]
DECODE_STEPS = 3


def make_config(q_lora_rank: int | None, rope: dict, interleave: bool = True) -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=32,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_interleave=interleave,
        rope_parameters=dict(rope),
        max_position_embeddings=64 * 40,
        rms_norm_eps=1e-5,  # not the latent norms' eps: transformers builds those with 1e-6
        attn_implementation="eager",
    )


@dataclass
class Reference:
    config: DeepseekV3Config
    attn: DeepseekV3Attention
    rotary: DeepseekV3RotaryEmbedding

    def causal(self, x: torch.Tensor) -> torch.Tensor:
        """x: (S, D) one whole sequence -> (S, D): every position's output, as decoding would give it."""
        s = x.shape[0]
        cos, sin = self.rotary(x, torch.arange(s)[None])
        mask = torch.full((s, s), float("-inf"), dtype=x.dtype).triu(1)[None, None]
        out, _ = self.attn(x[None], (cos, sin), mask)
        return out[0]

    def cos_sin(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, R) each at ragged positions: the reference's own rotary embedding (YaRN's factor folded in)."""
        cos, sin = self.rotary(x, positions[None])
        return cos[0], sin[0]


def make_reference(config: DeepseekV3Config, seed: int = 0) -> Reference:
    torch.manual_seed(seed)
    attn = DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            if p.ndim == 1:  # the RMSNorm weights, ones at init
                p.uniform_(0.5, 1.5)
            else:  # large enough that softmax is far from uniform
                p.normal_(0.0, 0.3)
    return Reference(config, attn, DeepseekV3RotaryEmbedding(config))


def shape_of(config: DeepseekV3Config) -> MlaShape:
    """What the family reader makes of the config (its softmax scale checked against the reference's own)."""
    return mla_shape(ModelSpec.from_hf_config({**config.to_dict(), "first_k_dense_replace": 0}))  # attention only


def weights_of(ref: Reference, shape: MlaShape, dtype: torch.dtype) -> MlaWeights:
    state = {name: t.detach().to(dtype) for name, t in ref.attn.state_dict().items()}
    return mla_weights_from_hf(shape, state)


def shuffled_tables(lengths: list[int], seed: int) -> tuple[tuple[int, ...], ...]:
    need = [-(-n // BLOCK_SIZE) for n in lengths]
    pool = list(range(sum(need) + 5))  # a few never used
    random.Random(seed).shuffle(pool)
    tables, start = [], 0
    for n in need:
        tables.append(tuple(pool[start : start + n]))
        start += n
    return tuple(tables)


def run_mla(
    ref: Reference,
    shape: MlaShape,
    w: MlaWeights,
    xs: list[torch.Tensor],
    cache: torch.Tensor,
    tables: tuple[tuple[int, ...], ...],
    rotate: RopeFn,
) -> list[torch.Tensor]:
    """Every phase of CHUNKS then DECODE_STEPS through our stages -> per sequence, its outputs after o_proj (S, D)."""
    seqs = range(len(xs))
    o_proj = ref.attn.o_proj.weight.detach().to(w.kv_a_layernorm.dtype)  # (D, H * Dv): the layer's wo
    phases = [[c[0] for c in CHUNKS], [c[1] for c in CHUNKS]] + [[1] * len(xs)] * DECODE_STEPS
    done = [0] * len(xs)
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    for q_lens in phases:
        ctx = [d + q for d, q in zip(done, q_lens, strict=True)]
        meta = AttentionMetadata(tuple(q_lens), tuple(ctx), tables, BLOCK_SIZE)
        plan = plan_attention(meta)
        x = torch.cat([xs[b][done[b] : ctx[b]] for b in seqs])  # (T, D)
        cos, sin = ref.cos_sin(x, meta.positions())
        q, latent = mla_pre_attention(shape, w, x, cos, sin, rotate)
        write_latent(cache, latent, plan.write_slots)
        attn = mla_paged_attention(q, cache, plan, shape.softmax_scale, shape.kv_lora_rank)  # (T, H, C)
        assert attn.shape == (x.shape[0], shape.heads, shape.kv_lora_rank) and attn.dtype == x.dtype
        out = linear(mla_output(shape, w, attn), o_proj)  # (T, D): attention_output's wo
        for b, o in zip(seqs, out.split(q_lens), strict=True):
            outs[b].append(o)
        done = ctx
    return [torch.cat(o) for o in outs]


def run_case(
    config: DeepseekV3Config,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> tuple[list[torch.Tensor], list[torch.Tensor], Reference]:
    ref = make_reference(config, seed)
    ref.attn.to(dtype)
    shape = shape_of(config)
    gen = torch.Generator().manual_seed(seed + 1)
    lengths = [a + b + DECODE_STEPS for a, b in CHUNKS]
    xs = [torch.randn(n, config.hidden_size, generator=gen).to(dtype) for n in lengths]
    tables = shuffled_tables(lengths, seed)
    cache = torch.zeros(max(max(t) for t in tables) + 1, BLOCK_SIZE, 1, shape.latent_dim, dtype=cache_dtype or dtype)
    rotate = rope_interleaved if config.rope_interleave else apply_rope
    ours = run_mla(ref, shape, weights_of(ref, shape, dtype), xs, cache, tables, rotate)
    with torch.no_grad():
        expected = [ref.causal(x) for x in xs]
    return ours, expected, ref


@pytest.mark.parametrize("rope", [DEFAULT_ROPE, YARN], ids=["default", "yarn"])
@pytest.mark.parametrize("q_lora_rank", [32, None], ids=["q_lora", "q_proj"])
def test_prefill_and_decode_match_the_reference(q_lora_rank: int | None, rope: dict) -> None:
    ours, expected, ref = run_case(make_config(q_lora_rank, rope))
    assert shape_of(ref.config).softmax_scale == pytest.approx(ref.attn.scaling, rel=1e-12)
    for a, b in zip(ours, expected, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_half_split_rope() -> None:
    """rope_interleave=False: the rotation is stages/rope.apply_rope's (rotate_half)."""
    ours, expected, _ = run_case(make_config(32, YARN, interleave=False))
    for a, b in zip(ours, expected, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_decode_in_chunks_of_one_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gather budget below one sequence's blocks: every decode chunk is one sequence, same result."""
    monkeypatch.setitem(attention.CHUNK_BYTES, "cpu", 1)
    ours, expected, _ = run_case(make_config(32, YARN), seed=3)
    for a, b in zip(ours, expected, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_bf16_within_the_reference_own_rounding() -> None:
    """bf16 weights and activations, bf16 cache: our error against an fp32 run of the same bf16 weights stays
    within a few times the bf16 reference's own (absorption rounds at other places than expansion does)."""
    config = make_config(32, YARN)
    ours, ref_bf16, _ = run_case(config, torch.bfloat16)
    ref32 = make_reference(config)
    ref32.attn.to(torch.bfloat16).float()  # the same rounded weights, computed in fp32
    gen = torch.Generator().manual_seed(1)
    lengths = [a + b + DECODE_STEPS for a, b in CHUNKS]
    xs = [torch.randn(n, config.hidden_size, generator=gen).to(torch.bfloat16).float() for n in lengths]
    with torch.no_grad():
        exact = [ref32.causal(x) for x in xs]
    for a, r, e in zip(ours, ref_bf16, exact, strict=True):
        assert a.dtype == torch.bfloat16
        ours_err = (a.float() - e).abs()
        ref_err = (r.float() - e).abs()
        assert ours_err.mean() <= 2 * ref_err.mean()
        assert ours_err.max() <= 3 * ref_err.max()
        torch.testing.assert_close(a.float(), r.float(), atol=0.05 * e.abs().max().item(), rtol=0.05)


def test_fp32_model_over_a_bf16_cache() -> None:
    """q in fp32 over a bf16 latent cache: the gathered chunk is upcast, attended in fp32; only the
    cached latents are rounded."""
    ours, expected, _ = run_case(make_config(32, YARN), cache_dtype=torch.bfloat16)
    for a, b in zip(ours, expected, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=0.02 * b.abs().max().item(), rtol=0.02)


def test_cache_holds_the_reference_compressed_latent() -> None:
    """The cache is one head of C + R values per token, exactly what transformers' DynamicCache holds for
    MLA (kv_a_layernorm(compressed kv) as keys, the rotated rope key as values), never expanded to heads."""
    config = make_config(32, YARN)
    ref = make_reference(config)
    shape = shape_of(config)
    w = weights_of(ref, shape, torch.float32)
    s = 70
    x = torch.randn(s, config.hidden_size, generator=torch.Generator().manual_seed(5))
    tables = shuffled_tables([s], seed=2)
    cache = torch.zeros(max(tables[0]) + 1, BLOCK_SIZE, 1, shape.latent_dim)
    meta = AttentionMetadata((s - 1,), (s - 1,), tables, BLOCK_SIZE)
    for m in (meta, AttentionMetadata((1,), (s,), tables, BLOCK_SIZE)):  # a prefill, then one decode step
        plan = plan_attention(m)
        rows = x[m.ctx_lens[0] - m.q_lens[0] : m.ctx_lens[0]]
        _, latent = mla_pre_attention(shape, w, rows, *ref.cos_sin(rows, m.positions()))
        write_latent(cache, latent, plan.write_slots)

    past = DynamicCache(config=config)
    with torch.no_grad():
        for lo, hi in ((0, s - 1), (s - 1, s)):
            cos, sin = ref.rotary(x, torch.arange(lo, hi)[None])
            mask = torch.full((hi - lo, hi), float("-inf")).triu(lo + 1)[None, None]
            ref.attn(x[None, lo:hi], (cos, sin), mask, cache=past)
    kv_nope, k_rot = past.layers[0].keys[0, 0], past.layers[0].values[0, 0]  # (S, C), (S, R)

    assert cache.shape[2:] == (1, shape.kv_lora_rank + shape.qk_rope_head_dim)
    held = cache.view(-1, shape.latent_dim)[AttentionMetadata((s,), (s,), tables, BLOCK_SIZE).slot_mapping()]
    torch.testing.assert_close(held, torch.cat([kv_nope, k_rot], dim=-1), atol=1e-6, rtol=1e-6)
    # and nothing else was written: the unused slots (past the sequence, and blocks it never owned) are still 0
    assert cache.count_nonzero() == held.count_nonzero()


def test_weights_split_kv_b_proj_per_head() -> None:
    """w_uk / w_uv are kv_b_proj's per-head key and value rows: W_uk c and W_uv c are the reference's
    expanded keys and values (expand_kv)."""
    config = make_config(32, DEFAULT_ROPE)
    ref = make_reference(config)
    shape = shape_of(config)
    w = weights_of(ref, shape, torch.float32)
    assert w.w_uk.shape == (4, 16, 32) and w.w_uv.shape == (4, 16, 32)
    c = torch.randn(1, 1, 5, 32)
    with torch.no_grad():
        keys, values = ref.attn.expand_kv(c, torch.zeros(1, 1, 5, 8))  # (1, H, 5, N + R), (1, H, 5, Dv)
    torch.testing.assert_close(torch.einsum("hnc,sc->hsn", w.w_uk, c[0, 0]), keys[0, :, :, :16])
    torch.testing.assert_close(torch.einsum("hvc,sc->hsv", w.w_uv, c[0, 0]), values[0])
    assert sorted(ref.attn.state_dict()) == sorted(
        f"{n}.weight"
        for n in (
            "q_a_proj",
            "q_a_layernorm",
            "q_b_proj",
            "kv_a_proj_with_mqa",
            "kv_a_layernorm",
            "kv_b_proj",
            "o_proj",
        )
    )
    with pytest.raises(ValueError, match="not both"):
        dataclasses.replace(w, q_proj=torch.zeros(4 * 24, 64))
    with pytest.raises(ValueError, match="needs q_proj"):
        dataclasses.replace(w, q_b_proj=None)
