"""Reading HF config.json files: the parts every family's reader shares (moe_lightning/families/
holds one reader per family: where it spells its fields, its defaults, what it implies).
ModelSpec.from_hf_config builds the spec from a reader's fields and checks the values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moe_lightning.config.choices import DTYPE_NAMES
from moe_lightning.yarn import YarnScaling


class ModelSpecError(ValueError):
    """A config.json that we cannot serve; the message names the field."""


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """The dict of `model_dir`'s config.json."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelSpecError(f"{path} not found: a model directory needs an HF config.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelSpecError(f"{path} is not valid JSON: {exc}") from exc
    except RecursionError:  # json's parser recurses once per level: 100,000 nested brackets end it
        raise ModelSpecError(f"{path} is nested too deeply to be a model's config") from None
    if not isinstance(config, dict):
        raise ModelSpecError(f"{path} must be a JSON object, got a {type(config).__name__}")
    return config


def require(config: dict[str, Any], key: str) -> Any:
    if key not in config or config[key] is None:
        raise ModelSpecError(f"config.json is missing required field {key!r}")
    return config[key]


def rope_theta(config: dict[str, Any], default: float, types: tuple[str, ...] = ("default",)) -> float:
    """The rotary base; `types`: the rope_types the family reads (others are refused)."""
    # transformers 5 writes rope_parameters; released checkpoints carry a top-level rope_theta.
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in (*types, None):
        supported = ", ".join(repr(t) for t in types)
        raise ModelSpecError(f"rope_parameters.rope_type = {rope_type!r} is not supported; supported: {supported}")
    theta = params.get("rope_theta", config.get("rope_theta", default))
    return float(theta)


def yarn_scaling(config: dict[str, Any]) -> YarnScaling | None:
    """The YaRN scaling of rope_parameters (transformers 5) or rope_scaling (released configs), when its
    rope_type is "yarn"; absent fields as transformers takes them (a null beta is its default, a null
    factor max_position_embeddings / original_max_position_embeddings)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type")) != "yarn":
        return None
    original = params.get("original_max_position_embeddings") or config.get("max_position_embeddings")
    if not original:
        raise ModelSpecError("YaRN rope_parameters need original_max_position_embeddings")
    factor = params.get("factor")  # 0 is not "absent": it would divide the frequencies by zero (refused)
    if factor is None:
        factor = float(require(config, "max_position_embeddings")) / float(original)
    return YarnScaling(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=None if params.get("attention_factor") is None else float(params["attention_factor"]),
        truncate=bool(params.get("truncate", True)),
    )


def eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def checkpoint_dtype(config: dict[str, Any]) -> str:
    dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    if dtype not in DTYPE_NAMES:
        raise ModelSpecError(f"config.json dtype {dtype!r} is not supported; supported: {sorted(DTYPE_NAMES)}")
    return dtype


def common_fields(
    config: dict[str, Any],
    arch: str,
    rope_default: float,
    eps_default: float,
    attention_bias: bool = False,
    rope_types: tuple[str, ...] = ("default",),
) -> dict[str, Any]:
    """The fields every supported family spells the same way; `attention_bias`: whether the family
    reads attention_bias = true (as q/k/v biases) rather than refusing it; `rope_types`: the
    rope_parameters types it reads."""
    hidden = int(require(config, "hidden_size"))
    heads = int(require(config, "num_attention_heads"))
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ModelSpecError(f"hidden_act = {act!r} is not supported for {arch}; supported: 'silu'")
    if config.get("attention_bias") and not attention_bias:
        raise ModelSpecError(f"attention_bias = true is not supported for {arch}")
    head_dim = config.get("head_dim") or (hidden // heads if heads else 0)
    return dict(
        architecture=arch,
        hidden_size=hidden,
        num_layers=int(require(config, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        top_k=int(require(config, "num_experts_per_tok")),
        vocab_size=int(require(config, "vocab_size")),
        rope_theta=rope_theta(config, rope_default, rope_types),
        rms_norm_eps=float(config.get("rms_norm_eps", eps_default)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        dtype=checkpoint_dtype(config),
        max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
        bos_token_id=config.get("bos_token_id"),
    )
