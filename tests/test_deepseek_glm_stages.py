"""DeepSeek-V3's and GLM-4.5's routing and rotary pieces against transformers' own modules, built from
tiny random configs of its DeepseekV3Config / Glm4MoeConfig: the grouped sigmoid router (expert groups,
selection bias, scaling factor; fp32 and bf16 inputs), RoPE over part of a head (GLM-4.5), DeepSeek's
interleaved layout, YaRN (DeepSeek-V3's published factor 40, at positions past the original 4096) and
DeepSeek's softmax-scale correction. Bit-exact in fp32 and bf16: the same operations in the same order.
Each case also checks that what it tests makes a difference on its data (the bias, the groups, the
layout, YaRN), so a stage that ignored it would fail."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest
import torch
from transformers import DeepseekV3Config, Glm4MoeConfig
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds
from transformers.models.glm4_moe import modeling_glm4_moe as glm

from moe_lightning.stages.grouped_routing import route_grouped
from moe_lightning.stages.rope import Rope, apply_rope, rope_cos_sin, yarn_softmax_scale
from moe_lightning.yarn import YarnScaling

EXACT = dict(rtol=0.0, atol=0.0)  # same ops in the same order: no rounding may differ
TOKENS = 48
# DeepSeek-V3's published rope_scaling, and its 163840-token context
DEEPSEEK_YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=40,
    original_max_position_embeddings=4096,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=1.0,
)
DEEPSEEK_CONTEXT = 163840


def deepseek_config(**overrides: Any) -> DeepseekV3Config:
    base: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=16,
        v_head_dim=8,
        n_routed_experts=32,
        n_group=8,
        topk_group=3,
        num_experts_per_tok=6,
        routed_scaling_factor=2.5,
        max_position_embeddings=DEEPSEEK_CONTEXT,
        rope_parameters=dict(DEEPSEEK_YARN),
    )
    return DeepseekV3Config(**{**base, **overrides})


def glm_config(**overrides: Any) -> Glm4MoeConfig:
    base: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
    )
    return Glm4MoeConfig(**{**base, **overrides})


# ---- routing ---------------------------------------------------------------------------------------


def as_sets(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, A) each -> both ordered by expert id per token: the (id, weight) set, comparable."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def reference_router(cls: type, config: Any, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    router = cls(config)
    with torch.no_grad():  # fp32 weight and bias, as the reference keeps them in any model dtype
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * 0.3)
        router.e_score_correction_bias.copy_(torch.rand(router.num_experts, generator=gen) * 0.5)
    return router


ROUTER_CASES = {
    # n_group 8 > topk_group 3: the group limit decides; normalised, scaled by 2.5
    "deepseek_groups": (ds.DeepseekV3TopkRouter, deepseek_config, {}),
    "deepseek_unnormalised": (ds.DeepseekV3TopkRouter, deepseek_config, dict(norm_topk_prob=False)),
    # GLM-4.5: one group, every expert eligible
    "glm_one_group": (glm.Glm4MoeTopkRouter, glm_config, dict(routed_scaling_factor=2.5)),
    "glm_groups": (glm.Glm4MoeTopkRouter, glm_config, dict(n_group=4, topk_group=2)),
}


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ROUTER_CASES)
def test_route_grouped_matches_reference_router(case: str, x_dtype: torch.dtype) -> None:
    cls, make_config, overrides = ROUTER_CASES[case]
    config = make_config(**overrides)
    ref = reference_router(cls, config, seed=len(case))
    x = torch.randn(TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(1)).to(x_dtype)

    with torch.no_grad():
        _, ref_weights, ref_ids = ref(x)
    weights, ids = route_grouped(
        x,
        ref.weight,
        ref.e_score_correction_bias,
        config.num_experts_per_tok,
        config.n_group,
        config.topk_group,
        config.norm_topk_prob,
        config.routed_scaling_factor,
    )
    assert weights.dtype == torch.float32 and ids.dtype == torch.long
    assert weights.shape == ids.shape == (TOKENS, config.num_experts_per_tok)
    torch.testing.assert_close(as_sets(weights, ids), as_sets(ref_weights, ref_ids), **EXACT)

    # the case's data exercises what it names: the bias changes the choice, and so do the groups
    scores = torch.sigmoid(x.float() @ ref.weight.T)
    unbiased_ids = scores.topk(config.num_experts_per_tok, dim=-1)[1].sort(dim=-1)[0]
    assert (unbiased_ids != ids.sort(dim=-1)[0]).any(dim=-1).sum() > 0
    if config.topk_group < config.n_group:
        ungrouped_ids = (scores + ref.e_score_correction_bias).topk(config.num_experts_per_tok, dim=-1)[1]
        assert (ungrouped_ids.sort(dim=-1)[0] != ids.sort(dim=-1)[0]).any(dim=-1).sum() > 0
        groups = ids // (config.n_routed_experts // config.n_group)  # (T, A) each expert's group
        assert all(len(set(row.tolist())) <= config.topk_group for row in groups)
    if config.norm_topk_prob:
        torch.testing.assert_close(weights.sum(dim=-1), torch.full((TOKENS,), config.routed_scaling_factor))


def test_route_grouped_bf16_router_is_the_fp32_router_it_rounds_to() -> None:
    """A router stored in bf16 (the checkpoint's dtype) routes as the reference's fp32 copy of it:
    logits are computed in fp32 from both sides upcast, never in bf16."""
    config = deepseek_config()
    ref = reference_router(ds.DeepseekV3TopkRouter, config, seed=5)
    with torch.no_grad():
        ref.weight.copy_(ref.weight.to(torch.bfloat16).float())  # what loading a bf16 gate gives it
    x = torch.randn(TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        _, ref_weights, ref_ids = ref(x)
    args = (config.num_experts_per_tok, config.n_group, config.topk_group, True, config.routed_scaling_factor)
    weights, ids = route_grouped(x, ref.weight.to(torch.bfloat16), ref.e_score_correction_bias, *args)
    torch.testing.assert_close(as_sets(weights, ids), as_sets(ref_weights, ref_ids), **EXACT)
    # whereas bf16 logits (the softmax router's `linear` in the model dtype) would weigh differently
    bf16_scores = torch.sigmoid((x @ ref.weight.to(torch.bfloat16).T).float())
    assert not torch.equal(bf16_scores.gather(1, ids), torch.sigmoid(x.float() @ ref.weight.T).gather(1, ids))


def test_route_grouped_no_tokens() -> None:
    config = deepseek_config()
    ref = reference_router(ds.DeepseekV3TopkRouter, config, seed=0)
    x = torch.zeros(0, config.hidden_size)
    weights, ids = route_grouped(x, ref.weight, ref.e_score_correction_bias, 6, 8, 3, True, 2.5)
    assert weights.shape == ids.shape == (0, 6)


# ---- rotary ----------------------------------------------------------------------------------------


def rope_from(config: Any, interleaved: bool = False) -> Rope:
    """Our Rope from a transformers config, as a family reader would build it (kept here: tests only)."""
    params = config.rope_parameters
    rotary_dim = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
    yarn = None
    if params["rope_type"] == "yarn":
        yarn = YarnScaling(**{f.name: params[f.name] for f in fields(YarnScaling) if params.get(f.name) is not None})
    return Rope(params["rope_theta"], rotary_dim, interleaved, yarn)


def positions(n: int, top: int, seed: int) -> torch.Tensor:
    """(n,) distinct positions in [0, top), ragged-batch style: unsorted, small and large."""
    return torch.randperm(top, generator=torch.Generator().manual_seed(seed))[:n]


def reference_cos_sin(rotary: torch.nn.Module, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    cos, sin = rotary(torch.zeros(1, dtype=dtype), pos[None, :])  # (1, T, r) each
    return cos[0], sin[0]


def check_cos_sin(rope: Rope, rotary: torch.nn.Module, pos: torch.Tensor) -> None:
    torch.testing.assert_close(rope.inv_freq(), rotary.inv_freq, **EXACT)
    assert rope.attention_factor == rotary.attention_scaling
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = rope.cos_sin(pos, dtype)
        assert cos.dtype == sin.dtype == dtype and cos.shape == (len(pos), rope.rotary_dim)
        torch.testing.assert_close((cos, sin), reference_cos_sin(rotary, pos, dtype), **EXACT)


YARN_VARIANTS = {
    "published": {},  # mscale == mscale_all_dim: attention factor exactly 1
    "mscale_ratio": dict(mscale=0.707, mscale_all_dim=1.0),  # attention factor != 1
    "no_mscale": dict(mscale=None, mscale_all_dim=None),  # attention factor from factor alone
    "untruncated": dict(truncate=False, beta_fast=24.5, beta_slow=1.5),
    # a ramp past both ends of the rotary dims, clamped to them
    "clamped": dict(rope_theta=100.0, beta_fast=2048, beta_slow=0.001),
    "explicit_attention_factor": dict(attention_factor=0.875),
}


def deepseek_yarn(**variant: Any) -> dict[str, Any]:
    params = {**DEEPSEEK_YARN, **variant}
    return {k: v for k, v in params.items() if v is not None}


@pytest.mark.parametrize("variant", YARN_VARIANTS)
def test_deepseek_yarn_interleaved_rope_matches_reference(variant: str) -> None:
    """DeepSeek-V3's attention: q's rope dims per head (after the head split), the one shared key's rope
    dims (MLA's k_rot, (T, R)), interleaved, at positions up to 163840 (past the original 4096)."""
    config = deepseek_config(rope_parameters=deepseek_yarn(**YARN_VARIANTS[variant]))
    rotary = ds.DeepseekV3RotaryEmbedding(config)
    rope = rope_from(config, interleaved=config.rope_interleave)
    assert rope.interleaved and rope.rotary_dim == config.qk_rope_head_dim and rope.yarn is not None
    pos = torch.cat([positions(TOKENS - 8, DEEPSEEK_CONTEXT, seed=3), torch.arange(8)])
    assert (pos > 4096).sum() > TOKENS // 2
    check_cos_sin(rope, rotary, pos)

    gen = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(TOKENS, config.num_attention_heads, rope.rotary_dim, generator=gen).to(dtype)  # (T, H, R)
        k = torch.randn(TOKENS, rope.rotary_dim, generator=gen).to(dtype)  # (T, R)
        cos, sin = rope.cos_sin(pos, dtype)
        ref_cos, ref_sin = reference_cos_sin(rotary, pos, dtype)
        # the reference's layout: (B, heads, S, R), cos/sin (B, S, R)
        ref_q, ref_k = ds.apply_rotary_pos_emb_interleave(
            q.transpose(0, 1)[None], k[None, None], ref_cos[None], ref_sin[None]
        )
        torch.testing.assert_close(rope.apply(q, cos, sin), ref_q[0].transpose(0, 1), **EXACT)
        torch.testing.assert_close(rope.apply(k, cos, sin), ref_k[0, 0], **EXACT)

    # the layout and YaRN both matter on these inputs
    half = Rope(rope.theta, rope.rotary_dim, interleaved=False, yarn=rope.yarn)
    assert not torch.allclose(half.apply(q, cos, sin), rope.apply(q, cos, sin))
    plain = Rope(rope.theta, rope.rotary_dim, interleaved=True)
    assert not torch.allclose(plain.cos_sin(pos, torch.float32)[0], rope.cos_sin(pos, torch.float32)[0])


@pytest.mark.parametrize("rope_type", ["default", "yarn"])
def test_deepseek_half_split_rope_matches_reference(rope_type: str) -> None:
    """rope_interleave false: transformers' plain `apply_rotary_pos_emb` on the rope dims."""
    params = DEEPSEEK_YARN if rope_type == "yarn" else {"rope_type": "default", "rope_theta": 10000.0}
    config = deepseek_config(rope_interleave=False, rope_parameters=dict(params))
    rotary = ds.DeepseekV3RotaryEmbedding(config)
    rope = rope_from(config, interleaved=config.rope_interleave)
    pos = positions(TOKENS, DEEPSEEK_CONTEXT, seed=6)
    check_cos_sin(rope, rotary, pos)
    q = torch.randn(TOKENS, config.num_attention_heads, rope.rotary_dim, generator=torch.Generator().manual_seed(7))
    k = torch.randn(TOKENS, 1, rope.rotary_dim, generator=torch.Generator().manual_seed(8))
    cos, sin = rope.cos_sin(pos, torch.float32)
    ref_q, ref_k = ds.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(rope.apply(q, cos, sin), ref_q[0].transpose(0, 1), **EXACT)
    torch.testing.assert_close(rope.apply(k, cos, sin), ref_k[0].transpose(0, 1), **EXACT)


GLM_ROPES = {
    "partial": {"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
    # YaRN over a partial rotary: the correction range is over the rotated dims only
    "partial_yarn": {
        "rope_type": "yarn",
        "rope_theta": 1_000_000.0,
        "partial_rotary_factor": 0.5,
        "factor": 4.0,
        "original_max_position_embeddings": 2048,
    },
}


@pytest.mark.parametrize("variant", GLM_ROPES)
def test_glm_partial_rope_matches_reference(variant: str) -> None:
    """GLM-4.5: the leading half of each (q/k-normed) head rotates in the half-split layout, the rest
    passes through; q and k heads after the head split."""
    params = dict(GLM_ROPES[variant])
    config = glm_config(rope_parameters=params, max_position_embeddings=int(params.get("factor", 1) * 2048))
    rotary = glm.Glm4MoeRotaryEmbedding(config)
    rope = rope_from(config)
    assert rope.rotary_dim == config.head_dim // 2 and not rope.interleaved
    pos = positions(TOKENS, config.max_position_embeddings, seed=9)
    check_cos_sin(rope, rotary, pos)

    gen = torch.Generator().manual_seed(10)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(TOKENS, config.num_attention_heads, config.head_dim, generator=gen).to(dtype)  # (T, H, Hd)
        k = torch.randn(TOKENS, config.num_key_value_heads, config.head_dim, generator=gen).to(dtype)  # (T, K, Hd)
        cos, sin = rope.cos_sin(pos, dtype)
        ref_q, ref_k = glm.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
        out_q, out_k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        torch.testing.assert_close(out_q, ref_q[0].transpose(0, 1), **EXACT)
        torch.testing.assert_close(out_k, ref_k[0].transpose(0, 1), **EXACT)
        assert torch.equal(out_q[..., rope.rotary_dim :], q[..., rope.rotary_dim :])  # passed through
        assert not torch.equal(out_q[..., : rope.rotary_dim], q[..., : rope.rotary_dim])
    if variant == "partial_yarn":
        assert rope.attention_factor != 1.0


def test_rope_full_rotary_equals_existing_functions() -> None:
    """Without YaRN or interleaving, Rope is rope_cos_sin + apply_rope (what pre_attention calls)."""
    pos = positions(TOKENS, 4096, seed=11)
    x = torch.randn(TOKENS, 3, 16, generator=torch.Generator().manual_seed(12))
    rope = Rope(10000.0, 16)
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = rope.cos_sin(pos, dtype)
        torch.testing.assert_close((cos, sin), rope_cos_sin(pos, 16, 10000.0, dtype), **EXACT)
        torch.testing.assert_close(rope.apply(x.to(dtype), cos, sin), apply_rope(x.to(dtype), cos, sin), **EXACT)


# ---- softmax scale ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        DEEPSEEK_YARN,
        deepseek_yarn(mscale_all_dim=0.707),  # where scale * m * m != scale * m**2
        deepseek_yarn(mscale_all_dim=None),  # no mscale_all_dim: no correction
        {"rope_type": "default", "rope_theta": 10000.0},
    ],
    ids=["published", "mscale_all_dim_0.707", "no_mscale_all_dim", "default"],
)
def test_yarn_softmax_scale_matches_deepseek_attention(params: dict[str, Any]) -> None:
    config = deepseek_config(rope_parameters=dict(params))
    attention = ds.DeepseekV3Attention(config, layer_idx=0)
    rope = rope_from(config, interleaved=True)
    qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim  # not MLA's cached C + R
    assert yarn_softmax_scale(qk_head_dim**-0.5, rope.yarn) == attention.scaling
    if params.get("mscale_all_dim"):
        assert attention.scaling != qk_head_dim**-0.5
