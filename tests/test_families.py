"""More MoE families, expressed as data (ModelSpec fields, weight names) plus small stage variants,
exact against transformers' own model class: OLMoE (q/k RMSNorm over the projection, optional
clip_qkv, top-k weights not renormalised), Qwen2-MoE (QKV bias, shared expert with a sigmoid gate),
Qwen3-MoE (q/k RMSNorm per head, norm_topk_prob), both with dense decoder layers (mlp_only_layers,
decoder_sparse_step), and DBRX (fused Wqkv with clip_qkv, LayerNorm without bias, experts stored as
(E * I, D) blocks, top-k weights divided by their L_p norm).
In process: a ragged batch, prefill + 16 greedy decode steps, logits within 1e-4 x max(1, |logit|)
at every step. Through the whole multi-process stack, with experts streamed: identical tokens."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moe_lightning.checkpoint import load_model_weights
from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.engine import InProcessEngine
from moe_lightning.launcher import Stack
from moe_lightning.request import GenerationRequest
from moe_lightning.spec import ModelSpec

from reference import assert_engine_matches, assert_top_logprobs_match, device_budget, hf_greedy, load_hf, save_hf

STEPS = 17  # the prefill's token + 16 decode steps
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
CONFIGS = {
    "olmoe_gqa_top2": (
        "olmoe",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=256,
            rope_parameters=ROPE,
            eos_token_id=None,
            pad_token_id=0,
            bos_token_id=1,
        ),
    ),
    "olmoe_mha_clip_norm": (  # clip_qkv and renormalised top-k, multi-head attention
        "olmoe",
        dict(
            vocab_size=200,
            hidden_size=48,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=3,
            num_key_value_heads=3,
            num_experts=6,
            num_experts_per_tok=3,
            clip_qkv=0.05,
            norm_topk_prob=True,
            max_position_embeddings=256,
            rope_parameters=ROPE,
            eos_token_id=None,
            pad_token_id=0,
            bos_token_id=1,
        ),
    ),
    "qwen3_moe_head_dim": (  # head_dim != hidden / heads, renormalised top-k
        "qwen3_moe",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            max_position_embeddings=256,
            rope_parameters=ROPE,
            eos_token_id=None,
            bos_token_id=1,
        ),
    ),
    "qwen3_moe_top4_unnormalised_dense1": (  # layer 1 is dense (mlp_only_layers)
        "qwen3_moe",
        dict(
            mlp_only_layers=[1],
            vocab_size=300,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            num_experts=12,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            max_position_embeddings=256,
            rope_parameters=ROPE,
            eos_token_id=None,
            bos_token_id=1,
        ),
    ),
}
CONFIGS["dbrx_gqa_clip_top2"] = (  # fused Wqkv clipped, LayerNorm without bias, experts in (E*I, D) blocks
    "dbrx",
    dict(
        vocab_size=256,
        d_model=64,
        n_layers=2,
        n_heads=4,
        max_seq_len=256,
        eos_token_id=None,
        bos_token_id=1,
        attn_config={"kv_n_heads": 2, "clip_qkv": 0.08, "rope_theta": 10000},
        ffn_config={"ffn_hidden_size": 40, "moe_num_experts": 8, "moe_top_k": 2},
    ),
)
CONFIGS["dbrx_mha_top4_p2"] = (  # 16 experts top-4 as DBRX, top-k weights divided by their L2 norm
    "dbrx",
    dict(
        vocab_size=200,
        d_model=48,
        n_layers=2,
        n_heads=3,
        max_seq_len=256,
        eos_token_id=None,
        bos_token_id=1,
        # clip_qkv 8 as dbrx-base (transformers 5.24's DBRX cannot run without a clip value)
        attn_config={"kv_n_heads": 3, "clip_qkv": 8.0, "rope_theta": 500000},
        ffn_config={"ffn_hidden_size": 24, "moe_num_experts": 16, "moe_top_k": 4, "moe_normalize_expert_weights": 2.0},
    ),
)
CONFIGS["qwen2_moe_shared_gqa"] = (  # QKV bias, a shared expert with its sigmoid gate, top-k not renormalised
    "qwen2_moe",
    dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        max_position_embeddings=256,
        rope_parameters=ROPE,
        eos_token_id=None,
        bos_token_id=1,
    ),
)
CONFIGS["qwen2_moe_top4_norm_step2"] = (  # multi-head, 10 experts top-4 renormalised, a narrow shared
    # expert; decoder_sparse_step 2: layers 0 and 2 are dense, 1 and 3 have experts
    "qwen2_moe",
    dict(
        decoder_sparse_step=2,
        vocab_size=200,
        hidden_size=48,
        intermediate_size=64,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=3,
        num_key_value_heads=3,
        num_experts=10,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        max_position_embeddings=256,
        rope_parameters=ROPE,
        eos_token_id=None,
        bos_token_id=1,
    ),
)
CONFIGS["glm4_moe_groups_qk_norm"] = (  # GLM-4.5: sigmoid routing with a selection bias among the best 2 of
    # 4 expert groups, scaled; a shared expert without gate; layer 0 dense; QKV bias, per-head q/k norm, RoPE
    # over half of each head
    "glm4_moe",
    dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        attention_bias=True,
        use_qk_norm=True,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        eos_token_id=None,
        bos_token_id=1,
    ),
)
CONFIGS["glm4_moe_air_mha"] = (  # GLM-4.5-Air's kind: one group, no q/k norm; here no dense layer, no bias,
    # top-k weights not renormalised, a quarter of each head rotated, two shared experts
    "glm4_moe",
    dict(
        vocab_size=200,
        hidden_size=48,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=32,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        first_k_dense_replace=0,
        attention_bias=False,
        use_qk_norm=False,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        eos_token_id=None,
        bos_token_id=1,
    ),
)
CONFIGS["deepseek_v3_mla_yarn_groups"] = (  # DeepSeek-V3: MLA with q LoRA over a latent cache, interleaved
    # RoPE with YaRN (factor 4 over 32 positions: the prompts and decode run past them), 16 experts in 4 groups,
    # best 2 kept, top-4, scaled 2.5, a shared expert, layer 0 dense
    "deepseek_v3",
    dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=128,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        eos_token_id=None,
        bos_token_id=1,
    ),
)
CONFIGS["deepseek_v3_no_q_lora"] = (  # DeepSeek-V2-Lite's kind of attention: one q projection; default RoPE,
    # one group, top-2 not renormalised, no dense layer, v_head_dim != qk_nope_head_dim
    "deepseek_v3",
    dict(
        vocab_size=200,
        hidden_size=48,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=3,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        first_k_dense_replace=0,
        q_lora_rank=None,
        kv_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=12,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=None,
        bos_token_id=1,
    ),
)
CONFIGS["gpt_oss_sinks_windows_yarn"] = (  # GPT-OSS: sinks, a window of 8 on layers 0 and 2 (prompts and
    # generations run past it), q/k/v/o biases, YaRN, a biased router softmaxed over its top-2, clamped
    # SwiGLU experts with biases, gate/up interleaved
    "gpt_oss",
    dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=1,
    ),
)
PROMPTS = [
    [1, 17, 42, 99, 7, 3, 150, 11, 5, 8, 13, 21, 34],
    [1, 190],
    [1, 5, 6, 7, 8, 9, 10],
    [1, 66, 77, 88, 99, 111, 122, 133, 144, 155, 166, 177, 188, 199, 20, 30, 40, 50, 60, 70],
    [1, 3, 3, 3],
]


@pytest.fixture(scope="module", params=list(CONFIGS))
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family, overrides = CONFIGS[request.param]
    return save_hf(family, tmp_path_factory.mktemp(request.param), seed=3, **overrides)


@pytest.fixture(scope="module")
def hf_reference(family_model: Path) -> dict[int, tuple[list[int], list[torch.Tensor]]]:
    hf = load_hf(family_model)
    return {i: hf_greedy(hf, p, STEPS) for i, p in enumerate(PROMPTS)}


def test_spec_reads_the_family(family_model: Path) -> None:
    spec = ModelSpec.from_pretrained(family_model)
    hf = load_hf(family_model)
    c = hf.config
    arch = spec.architecture
    qk_norm = {"OlmoeForCausalLM": "full", "Qwen3MoeForCausalLM": "head", "DbrxForCausalLM": None}
    qk_norm |= {"Qwen2MoeForCausalLM": None, "DeepseekV3ForCausalLM": None, "GptOssForCausalLM": None}
    qk_norm["Glm4MoeForCausalLM"] = "head" if getattr(c, "use_qk_norm", False) is True else None
    sigmoid = arch in ("Glm4MoeForCausalLM", "DeepseekV3ForCausalLM")  # DeepSeek-V3's router and shared experts
    glm_bias = arch == "Glm4MoeForCausalLM" and c.attention_bias
    gpt_oss = arch == "GptOssForCausalLM"
    assert spec.qkv_bias == (arch == "Qwen2MoeForCausalLM" or glm_bias or gpt_oss)
    assert (spec.shared_expert_size > 0) == (arch == "Qwen2MoeForCausalLM" or sigmoid)
    assert spec.shared_expert_gate == (not sigmoid) or not spec.shared_expert_size
    assert spec.qk_norm == qk_norm[arch]
    assert spec.norm == ("layer" if arch == "DbrxForCausalLM" else "rms")
    assert spec.attention == ("mla" if arch == "DeepseekV3ForCausalLM" else "gqa")
    assert spec.num_parameters() == sum(p.numel() for p in hf.parameters())
    if arch.startswith(("Qwen", "Glm", "Deepseek")):  # transformers' own rule decides which layers are dense
        mlps = [type(layer.mlp).__name__ for layer in hf.model.layers]
        assert list(spec.dense_layers) == [i for i, name in enumerate(mlps) if name.endswith("MLP")]
    if sigmoid:
        assert (spec.router_score, spec.n_group, spec.topk_group) == ("sigmoid", c.n_group, c.topk_group)
        assert spec.routed_scaling_factor == c.routed_scaling_factor
    if arch == "Glm4MoeForCausalLM":
        assert spec.rope_dim == int(c.head_dim * c.rope_parameters["partial_rotary_factor"])
    if gpt_oss:  # the layers transformers windows, and every other quirk as a spec field
        assert [spec.window_of(i) for i in range(spec.num_layers)] == [
            c.sliding_window if t == "sliding_attention" else None for t in c.layer_types
        ]
        assert (spec.attention_sinks, spec.o_bias, spec.expert_bias, spec.router_score) == (
            True,
            True,
            True,
            "softmax_topk",
        )
        assert (spec.activation, spec.swiglu_alpha, spec.swiglu_limit) == ("clamped_swiglu", 1.702, 7.0)
        assert spec.yarn is not None and spec.yarn.truncate is False
    if spec.attention == "mla":  # one latent row per token and layer, of kv_lora_rank + rope dims
        assert (spec.num_kv_heads, spec.head_dim) == (1, c.kv_lora_rank + c.qk_rope_head_dim)
        assert spec.kv_tensors == 1 and (spec.yarn is not None) == (c.rope_parameters["rope_type"] == "yarn")


def test_ragged_batch_matches_transformers(family_model: Path, hf_reference: dict) -> None:
    spec = ModelSpec.from_pretrained(family_model)
    engine = InProcessEngine(spec, load_model_weights(family_model, spec, progress=False), block_size=4)
    assert_engine_matches(engine, PROMPTS, STEPS, [hf_reference[i] for i in range(len(PROMPTS))])


def test_the_stack_with_streamed_experts_matches_transformers(
    family_model: Path, hf_reference: dict, make_stack: Callable[..., Stack]
) -> None:
    spec = ModelSpec.from_pretrained(family_model)
    s = make_stack(
        model=family_model,
        kv_cache_memory="16MiB",
        micro_batch_size=2,
        device_memory=str(device_budget(family_model, spec.num_experts + 1)),  # one layer + a page
        experts_placement="gpu",
    )
    with GenerationClient(s.api_address, timeout=120) as c:
        done = c.batch_generate(
            [Prompt(token_ids=p, max_new_tokens=STEPS, ignore_eos=True, logprobs=20) for p in PROMPTS]
        )
    with urllib.request.urlopen(s.endpoints()["gpu_expert"]["metrics"], timeout=10) as r:
        metrics = r.read().decode()
    s.stop()
    assert float(re.search(r"^moe_lightning_expert_bytes_streamed_total (\S+)", metrics, re.M)[1]) > 0
    assert_top_logprobs_match(done, [hf_reference[i] for i in range(len(PROMPTS))], STEPS)
    assert s.leaked_segments() == []


@pytest.mark.parametrize("arch", ["olmoe", "qwen2-moe", "qwen3-moe", "dbrx", "glm4-moe", "deepseek-v3", "gpt-oss"])
def test_make_demo_model_writes_each_family(arch: str, tmp_path: Path) -> None:
    """`make-demo-model --family` needs no transformers to write, and transformers loads what it wrote
    with the right class and computes the same logits we do."""
    from moe_lightning.demo_model import PRESETS, write_demo_model

    preset: str | dict = "tiny"
    if arch.startswith("qwen"):  # with a dense layer between two sparse ones
        preset = PRESETS["tiny"] | {"num_hidden_layers": 3, "mlp_only_layers": [1]}
    out = write_demo_model(tmp_path / arch, preset, seed=5, progress=False, arch=arch)
    spec = ModelSpec.from_pretrained(out)
    assert spec.dense_layers == {"qwen2-moe": (1,), "qwen3-moe": (1,), "glm4-moe": (0,), "deepseek-v3": (0,)}.get(
        arch, ()
    )
    hf = load_hf(out)
    assert type(hf).__name__ == spec.architecture
    engine = InProcessEngine(spec, load_model_weights(out, spec, progress=False))
    ours: list[torch.Tensor] = []
    [result], _ = engine.generate(
        [GenerationRequest(PROMPTS[0], max_new_tokens=6, ignore_eos=True)],
        on_logits=lambda step, idx, logits: ours.append(logits[0].clone()),
    )
    ref_tokens, ref_logits = hf_greedy(hf, PROMPTS[0], 6)
    assert result.token_ids == ref_tokens
    for a, b in zip(ours, ref_logits, strict=True):
        assert (a - b).abs().max().item() <= 1e-4 * max(1.0, b.abs().max().item())


def test_plan_presets_have_the_real_sizes() -> None:
    from moe_lightning.hrm.archs import ARCHS

    assert round(ARCHS["olmoe-1b-7b"].num_parameters() / 1e9, 1) == 6.9  # OLMoE-1B-7B
    assert round(ARCHS["qwen3-30b-a3b"].num_parameters() / 1e9, 1) == 30.5  # Qwen3-30B-A3B
    assert round(ARCHS["qwen1.5-moe-a2.7b"].num_parameters() / 1e9, 1) == 14.3  # Qwen1.5-MoE-A2.7B
    assert round(ARCHS["qwen3-235b-a22b"].num_parameters() / 1e9, 1) == 235.1  # Qwen3-235B-A22B
    assert round(ARCHS["glm-4.5-air"].num_parameters() / 1e9, 1) == 106.9  # GLM-4.5-Air, without its MTP layer
    assert round(ARCHS["deepseek-v3"].num_parameters() / 1e9) == 671  # DeepSeek-V3, without its MTP layer
    assert round(ARCHS["gpt-oss-120b"].num_parameters() / 1e9, 2) == 116.83  # gpt-oss-120b's model card
    assert round(ARCHS["gpt-oss-20b"].num_parameters() / 1e9, 2) == 20.91  # gpt-oss-20b's


def test_deepseek_v3_plans_by_its_latent_kv_bytes() -> None:
    """`plan --arch deepseek-v3`: a token's KV in a layer is its latent row, 512 + 64 values (1,152 bytes in
    bf16), not 128 heads' keys and values (65,536): the host holds ~57x the sequences a GQA cache would."""
    from dataclasses import replace

    from moe_lightning.hrm.archs import ARCHS
    from moe_lightning.hrm.hardware import PRESETS
    from moe_lightning.hrm.layercost import Headroom, Workload
    from moe_lightning.hrm.optimizer import max_batch
    from moe_lightning.hrm.sizes import kv_token_bytes

    spec = ARCHS["deepseek-v3"]
    assert kv_token_bytes(spec, "bfloat16") == (512 + 64) * 2
    box = PRESETS["h100"].scaled(cpu_memory=2.5e12 / PRESETS["h100"].cpu_memory)  # bf16 weights: 1.34 TB
    work = Workload(77, 32)
    as_gqa = replace(spec, attention="gqa", num_kv_heads=128, head_dim=128, kv_lora_rank=0)  # K and V per head
    assert kv_token_bytes(as_gqa, "bfloat16") == 2 * 128 * 128 * 2
    latent, full = (max_batch(s, work, box, None, Headroom(), 10**7) for s in (spec, as_gqa))
    assert latent > 40 * full > 0


def test_the_registry_is_the_one_list_of_families() -> None:
    """The CLI's --family choices, the supported architectures, the plan presets and the reference's
    families all come from moe_lightning/families/; a config names its family by architecture or,
    without one, by model_type; an unknown one is refused with the list."""
    from moe_lightning import families
    from moe_lightning.cli import build_parser
    from moe_lightning.demo_model import PRESETS
    from moe_lightning.hf_configs import ModelSpecError
    from moe_lightning.hrm.archs import ARCHS

    from reference import FAMILIES as REFERENCE

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    family_flag = next(a for a in sub.choices["make-demo-model"]._actions if a.dest == "family")
    assert tuple(family_flag.choices) == families.FAMILY_NAMES
    assert {model for _, model in REFERENCE.values()} == set(families.SUPPORTED_ARCHITECTURES)
    assert {n: p for f in families.FAMILIES for n, p in f.plan_presets.items()} == ARCHS
    assert all(families.by_architecture(p.architecture).plan_presets[n] is p for n, p in ARCHS.items())
    for f in families.FAMILIES:
        config = families.by_name(f.name).demo_config(PRESETS["tiny"], "float32")
        assert families.of_config(config) is f
        assert families.of_config({"model_type": f.model_type}) is f
        assert ModelSpec.from_hf_config(config).architecture == f.architecture
    with pytest.raises(ModelSpecError, match="'GPT2LMHeadModel' is not supported; supported: MixtralForCausalLM"):
        families.of_config({"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="unknown family 'llama'; choose one of mixtral, olmoe"):
        families.by_name("llama")
