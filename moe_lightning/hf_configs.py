"""HF config.json -> ModelSpec's fields, one reader per family: where each family spells its fields,
which defaults it has, and what it implies (Mixtral always renormalises its top-k, DBRX nests its
attention and FFN settings, Qwen-MoE's dense layers follow from mlp_only_layers and
decoder_sparse_step). ModelSpec.from_hf_config builds the spec from them and checks the values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moe_lightning.config.choices import DTYPE_NAMES

SUPPORTED_ARCHITECTURES = (
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "DbrxForCausalLM",
)
MODEL_TYPES = {
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "dbrx": "DbrxForCausalLM",
}


class ModelSpecError(ValueError):
    """A config.json that we cannot serve; the message names the field."""


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """The dict of `model_dir`'s config.json."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelSpecError(f"{path} not found: a model directory needs an HF config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelSpecError(f"{path} is not valid JSON: {exc}") from exc


def _require(config: dict[str, Any], key: str) -> Any:
    if key not in config or config[key] is None:
        raise ModelSpecError(f"config.json is missing required field {key!r}")
    return config[key]


def _rope_theta(config: dict[str, Any], default: float) -> float:
    # transformers 5 writes rope_parameters; released checkpoints carry a top-level rope_theta.
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise ModelSpecError(f"rope_parameters.rope_type = {rope_type!r} is not supported; supported: 'default'")
    theta = params.get("rope_theta", config.get("rope_theta", default))
    return float(theta)


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _checkpoint_dtype(config: dict[str, Any]) -> str:
    dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    if dtype not in DTYPE_NAMES:
        raise ModelSpecError(f"config.json dtype {dtype!r} is not supported; supported: {sorted(DTYPE_NAMES)}")
    return dtype


def _common(config: dict[str, Any], arch: str, rope_default: float, eps_default: float) -> dict[str, Any]:
    """The fields every supported family spells the same way."""
    hidden = int(_require(config, "hidden_size"))
    heads = int(_require(config, "num_attention_heads"))
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ModelSpecError(f"hidden_act = {act!r} is not supported for {arch}; supported: 'silu'")
    if config.get("attention_bias"):
        raise ModelSpecError(f"attention_bias = true is not supported for {arch}")
    head_dim = config.get("head_dim") or (hidden // heads if heads else 0)
    return dict(
        architecture=arch,
        hidden_size=hidden,
        num_layers=int(_require(config, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        top_k=int(_require(config, "num_experts_per_tok")),
        vocab_size=int(_require(config, "vocab_size")),
        rope_theta=_rope_theta(config, rope_default),
        rms_norm_eps=float(config.get("rms_norm_eps", eps_default)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        dtype=_checkpoint_dtype(config),
        max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
        bos_token_id=config.get("bos_token_id"),
    )


def _parse_mixtral(config: dict[str, Any], arch: str) -> dict[str, Any]:
    return dict(
        **_common(config, arch, 1_000_000.0, 1e-5),
        intermediate_size=int(_require(config, "intermediate_size")),
        num_experts=int(_require(config, "num_local_experts")),
        norm_topk_prob=True,  # Mixtral always renormalises its top-k weights
        sliding_window=config.get("sliding_window"),
        eos_token_ids=_eos_ids(config.get("eos_token_id", 2)),
    )


def _parse_olmoe(config: dict[str, Any], arch: str) -> dict[str, Any]:
    clip = config.get("clip_qkv")
    return dict(
        **_common(config, arch, 10_000.0, 1e-5),
        intermediate_size=int(_require(config, "intermediate_size")),  # OLMoE's experts are this wide
        num_experts=int(config.get("num_experts") or _require(config, "num_local_experts")),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        eos_token_ids=_eos_ids(config.get("eos_token_id")),
        qk_norm="full",
        clip_qkv=None if clip is None else float(clip),
    )


def _qwen_moe(config: dict[str, Any], arch: str, **family: Any) -> dict[str, Any]:
    """What Qwen2-MoE and Qwen3-MoE share; `family` adds their differences."""
    layers = int(_require(config, "num_hidden_layers"))
    dense = _qwen_dense_layers(config, layers)
    if len(dense) == layers:
        raise ModelSpecError(
            f"every layer of this {arch} is dense (mlp_only_layers = {config.get('mlp_only_layers')}, "
            f"decoder_sparse_step = {config.get('decoder_sparse_step')}): it is not a mixture of experts"
        )
    return dict(
        **_common(config, arch, 10_000.0, 1e-6),
        intermediate_size=int(_require(config, "moe_intermediate_size")),
        # released configs say num_experts; transformers 5 writes num_local_experts
        num_experts=int(config.get("num_experts") or _require(config, "num_local_experts")),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        sliding_window=config.get("sliding_window") if config.get("use_sliding_window") else None,
        eos_token_ids=_eos_ids(config.get("eos_token_id")),
        dense_layers=dense,
        dense_intermediate_size=int(_require(config, "intermediate_size")) if dense else 0,
        **family,
    )


def _qwen_dense_layers(config: dict[str, Any], layers: int) -> tuple[int, ...]:
    """transformers' rule: layer i is sparse unless listed in mlp_only_layers or (i + 1) is not a
    multiple of decoder_sparse_step."""
    only = config.get("mlp_only_layers") or []
    step = config.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ModelSpecError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    if not isinstance(only, list) or any(not isinstance(i, int) or not 0 <= i < layers for i in only):
        raise ModelSpecError(f"mlp_only_layers must list layer indices in 0..{layers - 1}, got {only!r}")
    return tuple(i for i in range(layers) if i in only or (i + 1) % step)


def _parse_qwen2_moe(config: dict[str, Any], arch: str) -> dict[str, Any]:
    return _qwen_moe(
        config,
        arch,
        qkv_bias=bool(config.get("qkv_bias", True)),  # Qwen1.5/2-MoE checkpoints always have them
        shared_expert_size=int(config.get("shared_expert_intermediate_size") or 0),
    )


def _parse_qwen3_moe(config: dict[str, Any], arch: str) -> dict[str, Any]:
    return _qwen_moe(config, arch, qk_norm="head")


def _parse_dbrx(config: dict[str, Any], arch: str) -> dict[str, Any]:
    attn = config.get("attn_config") or {}
    ffn = config.get("ffn_config") or {}
    act = (ffn.get("ffn_act_fn") or {}).get("name", "silu")
    if act != "silu":
        raise ModelSpecError(f"ffn_config.ffn_act_fn = {act!r} is not supported for {arch}; supported: 'silu'")
    hidden = int(_require(config, "d_model"))
    heads = int(_require(config, "n_heads"))
    norm_p = ffn.get("moe_normalize_expert_weights", 1.0)
    clip = attn.get("clip_qkv")
    return dict(
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=int(_require(ffn, "ffn_hidden_size")),
        num_layers=int(_require(config, "n_layers")),
        num_heads=heads,
        num_kv_heads=int(attn.get("kv_n_heads") or heads),
        head_dim=hidden // heads if heads else 0,
        num_experts=int(_require(ffn, "moe_num_experts")),
        top_k=int(_require(ffn, "moe_top_k")),
        vocab_size=int(_require(config, "vocab_size")),
        norm_topk_prob=norm_p is not None,
        topk_norm_p=float(norm_p) if norm_p is not None else 1.0,
        # transformers 5 writes a top-level rope_parameters (and uses only that); released DBRX
        # configs carry attn_config.rope_theta (500000), which transformers 5.24 ignores
        rope_theta=_rope_theta(config, float(attn.get("rope_theta", 10_000.0))),
        rms_norm_eps=1e-5,  # nn.LayerNorm's default, which DBRX uses
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        dtype=_checkpoint_dtype(config),
        max_position_embeddings=int(config.get("max_seq_len", 2048)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_eos_ids(config.get("eos_token_id")),
        clip_qkv=None if clip is None else float(clip),
        norm="layer",
    )


_PARSERS = {
    "DbrxForCausalLM": _parse_dbrx,
    "MixtralForCausalLM": _parse_mixtral,
    "OlmoeForCausalLM": _parse_olmoe,
    "Qwen2MoeForCausalLM": _parse_qwen2_moe,
    "Qwen3MoeForCausalLM": _parse_qwen3_moe,
}


def spec_fields(config: dict[str, Any]) -> dict[str, Any]:
    """ModelSpec's fields from the dict of an HF config.json, by the family's reader (picked by
    architectures[0], else model_type)."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else None
    if arch is None:
        model_type = config.get("model_type")
        arch = MODEL_TYPES.get(model_type or "")
        if arch is None:
            raise ModelSpecError(
                f"config.json names no 'architectures' and model_type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelSpecError(
            f"architectures[0] = {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return _PARSERS[arch](config, arch)
