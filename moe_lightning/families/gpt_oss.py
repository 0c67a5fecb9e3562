"""GPT-OSS (GptOssForCausalLM): GQA with biases on q/k/v/o and a learned sink logit per head in each
softmax, layers alternating a sliding window with the whole context (layer_types), YaRN RoPE over the
two halves of a head; a router with a bias whose softmax spans the top-k logits only; experts with
biases and a clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate), whose gate and up columns are
interleaved in one (E, D, 2I) tensor (de-interleaved at load into our w13 rows, gate then up).
Published checkpoints keep the experts in MXFP4 (`*_blocks`, `*_scales`); transformers saves them
dequantized under the names above."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moe_lightning.checkpoint_error import CheckpointError
from moe_lightning.families import mixtral
from moe_lightning.families.family import HF_TOP_NAMES, Family, Randoms
from moe_lightning.families.gpt_oss_template import CHAT_TEMPLATE, HARMONY_TOKENS, STOP_TOKENS
from moe_lightning.hf_configs import ModelSpecError, common_fields, eos_ids, require, yarn_scaling
from moe_lightning.spec import ModelSpec

if TYPE_CHECKING:
    import torch

    from moe_lightning.checkpoint import CheckpointReader
    from moe_lightning.quant.kernels import QuantizedLinear
    from moe_lightning.weights import LayerWeights

ARCHITECTURE = "GptOssForCausalLM"
LAYER_TYPES = ("sliding_attention", "full_attention")


def read_config(config: dict[str, Any], arch: str) -> dict[str, Any]:
    fields = common_fields(config, arch, 150_000.0, 1e-5, attention_bias=True, rope_types=("default", "yarn"))
    layers = fields["num_layers"]
    # transformers' default when a config names none: sliding, full, sliding, ...
    types = config.get("layer_types") or [LAYER_TYPES[i % 2] for i in range(layers)]
    if len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ModelSpecError(f"layer_types must name {layers} layers, each one of {', '.join(LAYER_TYPES)}")
    window = config.get("sliding_window")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if sliding and not window:
        raise ModelSpecError("layer_types has sliding_attention layers but sliding_window is not set")
    bias = bool(config.get("attention_bias", True))
    return dict(
        fields,
        intermediate_size=int(require(config, "intermediate_size")),
        num_experts=int(require(config, "num_local_experts")),
        eos_token_ids=eos_ids(config.get("eos_token_id")),
        sliding_window=int(window) if sliding else None,
        sliding_layers=sliding if sliding else None,
        yarn=yarn_scaling(config),
        qkv_bias=bias,
        o_bias=bias,
        attention_sinks=True,
        router_score="softmax_topk",
        expert_bias=True,
        activation="clamped_swiglu",
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(config.get("swiglu_limit", 7.0)),
    )


def load_layer(
    reader: CheckpointReader, spec: ModelSpec, i: int, dtype: torch.dtype, device: torch.device | str
) -> LayerWeights:
    """Decoder layer i: q/k/v fused with their biases, o_proj and its bias, the sinks; the MoE block's
    fused expert tensors split per expert, gate/up de-interleaved."""
    import torch

    from moe_lightning.families.hf_layout import to_layout
    from moe_lightning.weights import ExpertWeights, LayerWeights

    d, e, inter = spec.hidden_size, spec.num_experts, spec.intermediate_size
    p, a, x = f"model.layers.{i}", f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp.experts"

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return to_layout(reader.get(name, shape), dtype, device)

    sizes = (("q_proj", spec.q_size), ("k_proj", spec.kv_size), ("v_proj", spec.kv_size))
    wqkv = torch.cat([reader.get(f"{a}.{proj}.weight", (rows, d)) for proj, rows in sizes])
    bias = torch.cat([reader.get(f"{a}.{proj}.bias", (rows,)) for proj, rows in sizes])
    gate_up_bias = reader.get(f"{x}.gate_up_proj_bias", (e, 2 * inter))
    down_bias = reader.get(f"{x}.down_proj_bias", (e, d))
    if f"{x}.gate_up_proj_blocks" in reader:  # published: MXFP4, kept as it is (rows de-interleaved)
        w13s, w2s = _mxfp4_experts(reader, x, e, d, inter, device)
    else:  # transformers' save_pretrained: dequantized, (E, D, 2I) / (E, I, D), inputs first
        gate_up = reader.get(f"{x}.gate_up_proj", (e, d, 2 * inter))  # gate, up, gate, up, ... columns
        down = reader.get(f"{x}.down_proj", (e, inter, d))
        w13s = [to_layout(deinterleave(gate_up[j].T), dtype, device) for j in range(e)]  # (2I, D)
        w2s = [to_layout(down[j].T, dtype, device) for j in range(e)]  # (D, I)
    experts = [
        ExpertWeights(
            w13s[j],
            w2s[j],
            to_layout(deinterleave(gate_up_bias[j]), dtype, device),
            to_layout(down_bias[j], dtype, device),
        )
        for j in range(e)
    ]
    return LayerWeights(
        attn_norm=get(f"{p}.input_layernorm.weight", (d,)),
        wqkv=to_layout(wqkv, dtype, device),
        wqkv_bias=to_layout(bias, dtype, device),
        wo=get(f"{a}.o_proj.weight", (d, spec.q_size)),
        wo_bias=get(f"{a}.o_proj.bias", (d,)),
        sinks=get(f"{a}.sinks", (spec.num_heads,)),
        ffn_norm=get(f"{p}.post_attention_layernorm.weight", (d,)),
        router=get(f"{p}.mlp.router.weight", (e, d)),
        router_bias=get(f"{p}.mlp.router.bias", (e,)),
        experts=experts,
    )


def _mxfp4_experts(
    reader: CheckpointReader, prefix: str, e: int, d: int, inter: int, device: torch.device | str
) -> tuple[list[QuantizedLinear], list[QuantizedLinear]]:
    """The experts' `*_blocks` (E, N, K/32, 16) and `*_scales` (E, N, K/32) as MXFP4 linears (N, K) per
    expert: the bytes as published, the gate/up rows de-interleaved (a row permutation: exact), computed
    by the MXFP4 kernel of the side that holds them (quant/kernels.py)."""
    from moe_lightning.quant.kernels import QuantizedLinear
    from moe_lightning.quant.mxfp4 import scale_problem
    from moe_lightning.quant.scheme import MXFP4_BLOCK, QuantFormat

    out = []
    for name, n, k in (("gate_up_proj", 2 * inter, d), ("down_proj", d, inter)):
        if k % MXFP4_BLOCK:
            raise ModelSpecError(f"{name}: MXFP4 needs input widths that are multiples of {MXFP4_BLOCK}, got {k}")
        g = k // MXFP4_BLOCK
        blocks = reader.get(f"{prefix}.{name}_blocks", (e, n, g, MXFP4_BLOCK // 2))
        scales = reader.get(f"{prefix}.{name}_scales", (e, n, g))
        problem = scale_problem(blocks, scales)
        if problem is not None:  # every request would sample from NaN logits: refused at load, by name
            entry = reader.entry(f"{prefix}.{name}_scales")
            raise CheckpointError(f"{entry.file}: tensor {entry.name!r} holds {problem}")
        if name == "gate_up_proj":  # rows gate 0, up 0, gate 1, ... -> gate rows, then up rows
            blocks, scales = deinterleave(blocks, dim=1), deinterleave(scales, dim=1)
        out.append(
            [QuantizedLinear(QuantFormat.MXFP4, blocks[j].reshape(n, k // 2), scales[j]).to(device) for j in range(e)]
        )
    return out[0], out[1]


def deinterleave(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Along `dim` (2I long): gate 0, up 0, gate 1, up 1, ... -> gate rows then up rows (our w13's order)."""
    import torch

    n = t.shape[dim]
    order = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)]).to(t.device)
    return t.index_select(dim, order)


def random_weights(spec: ModelSpec, rand: Randoms, progress: bool) -> dict[str, torch.Tensor]:
    """A random checkpoint under transformers' GPT-OSS names (experts fused, dequantized)."""
    from tqdm import tqdm

    d, inter, e, h = spec.hidden_size, spec.intermediate_size, spec.num_experts, spec.num_heads
    normal, norm = rand.normal, rand.norm
    sd: dict[str, torch.Tensor] = {HF_TOP_NAMES.embed: normal(spec.vocab_size, d)}
    for i in tqdm(range(spec.num_layers), desc="generating layers", unit="layer", disable=not progress, leave=False):
        p = f"model.layers.{i}"
        sd[f"{p}.input_layernorm.weight"] = norm(d)
        sd[f"{p}.post_attention_layernorm.weight"] = norm(d)
        for proj, rows in (("q_proj", spec.q_size), ("k_proj", spec.kv_size), ("v_proj", spec.kv_size)):
            sd[f"{p}.self_attn.{proj}.weight"] = normal(rows, d)
            sd[f"{p}.self_attn.{proj}.bias"] = normal(rows)
        sd[f"{p}.self_attn.o_proj.weight"] = normal(d, spec.q_size)
        sd[f"{p}.self_attn.o_proj.bias"] = normal(d)
        sd[f"{p}.self_attn.sinks"] = normal(h) * 20  # logits near the scores', so the sinks take a real share
        sd[f"{p}.mlp.router.weight"] = normal(e, d)
        sd[f"{p}.mlp.router.bias"] = normal(e) * 5  # large enough to change some choices
        x = f"{p}.mlp.experts"
        # gate/up large enough that some values pass the clamp (swiglu_limit)
        sd[f"{x}.gate_up_proj"] = normal(e, d, 2 * inter) * 40
        sd[f"{x}.gate_up_proj_bias"] = normal(e, 2 * inter) * 20
        sd[f"{x}.down_proj"] = normal(e, inter, d)
        sd[f"{x}.down_proj_bias"] = normal(e, d)
    sd[HF_TOP_NAMES.final_norm] = norm(d)
    if not spec.tie_word_embeddings:
        sd[HF_TOP_NAMES.lm_head] = normal(spec.vocab_size, d)
    return sd


def demo_config(preset: dict[str, Any], dtype: str) -> dict[str, Any]:
    """A GPT-OSS config.json with a preset's shapes: layers alternating a 16-token window and the whole
    context, YaRN over a quarter of the context, the published clamp."""
    config = mixtral.demo_config(preset, dtype)
    config.pop("rope_theta", None)
    layers = config["num_hidden_layers"]
    config.update(
        architectures=[ARCHITECTURE],
        model_type="gpt_oss",
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        sliding_window=16,
        layer_types=[LAYER_TYPES[i % 2] for i in range(layers)],
        attention_bias=True,
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150_000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": max(1, config["max_position_embeddings"] // 4),
        },
    )
    return config


def _gpt_oss(**shape: Any) -> ModelSpec:
    """A published GPT-OSS: what they share, and `shape`."""
    from moe_lightning.yarn import YarnScaling

    common = dict(
        architecture=ARCHITECTURE,
        hidden_size=2880,
        intermediate_size=2880,
        num_heads=64,
        num_kv_heads=8,
        head_dim=64,
        top_k=4,
        vocab_size=201088,
        max_position_embeddings=131072,
        dtype="bfloat16",
        rope_theta=150_000.0,
        rms_norm_eps=1e-5,
        sliding_window=128,
        yarn=YarnScaling(factor=32.0, original_max_position_embeddings=4096, truncate=False),
        qkv_bias=True,
        o_bias=True,
        attention_sinks=True,
        router_score="softmax_topk",
        expert_bias=True,
        activation="clamped_swiglu",
        bos_token_id=199998,
        eos_token_ids=(200002, 199999, 200012),
    )
    layers = shape["num_layers"]
    return ModelSpec(**(common | {"sliding_layers": tuple(range(0, layers, 2))} | shape))


PLAN_PRESETS = {
    # openai/gpt-oss-120b: 117 B parameters (5.1 B active), 128 experts top-4, 36 layers
    "gpt-oss-120b": _gpt_oss(num_layers=36, num_experts=128),
    # openai/gpt-oss-20b: 21 B parameters (3.6 B active), 32 experts top-4, 24 layers
    "gpt-oss-20b": _gpt_oss(num_layers=24, num_experts=32),
}

FAMILY = Family(
    name="gpt-oss",
    architecture=ARCHITECTURE,
    model_type="gpt_oss",
    read_config=read_config,
    load_layer=load_layer,
    top_names=HF_TOP_NAMES,
    demo_config=demo_config,
    random_weights=random_weights,
    plan_presets=PLAN_PRESETS,
    gptq_unsupported="GPT-OSS's experts are fused with biases; its published checkpoints are MXFP4, not GPTQ",
    published_experts="mxfp4",
    chat_template=CHAT_TEMPLATE,
    special_tokens=HARMONY_TOKENS,
    stop_tokens=STOP_TOKENS,
)
