"""What a config.json may describe: its values' types, counts and sizes within what we serve, every
number finite, and floats in the ranges that keep the model's arithmetic finite (docs/reliability.md,
"What one request may cost"). Torch-free: `up` refuses a config in well under a second.

Two layers, one table each. `check_hf_config` looks at config.json as written, before a family's
reader converts anything (its `int(...)` would take "12", true or 3.7 as a count): every field of a
kind below is checked by its kind, wherever the readers look (the top level and the nested objects
they read), and named as config.json spells it. `check_spec` holds a ModelSpec, however it was made
(a family's reader, a preset, JSON over the wire), to the same bounds by its own field names.
"""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_lightning.checkpoint_error import CheckpointError
from moe_lightning.config.units import format_size
from moe_lightning.hf_configs import ModelSpecError
from moe_lightning.safetensors_names import checkpoint_files

if TYPE_CHECKING:
    from moe_lightning.spec import ModelSpec

# The largest count or size served, by ModelSpec field: a few times the largest published model's
# (DeepSeek-V3: hidden 7168, 61 layers, 256 experts; vocabularies of 262,144; contexts of 10 M), far
# below what would make a layout of pages (one Python object each) or a KV cache take minutes or
# exhaust memory before anything is loaded.
SIZE_BOUNDS: dict[str, int] = {
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 18,
    "num_layers": 1 << 10,
    "num_heads": 1 << 10,
    "num_kv_heads": 1 << 10,
    "head_dim": 1 << 11,
    "num_experts": 1 << 13,
    "top_k": 1 << 13,
    "vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 24,
    "sliding_window": 1 << 24,
    "shared_expert_size": 1 << 18,
    "dense_intermediate_size": 1 << 18,
    "n_group": 1 << 13,
    "topk_group": 1 << 13,
    "rotary_dim": 1 << 11,
    "q_lora_rank": 1 << 16,
    "kv_lora_rank": 1 << 16,
    "qk_nope_head_dim": 1 << 11,
    "qk_rope_head_dim": 1 << 11,
    "v_head_dim": 1 << 11,
    "bos_token_id": (1 << 22) - 1,
}
# (sparse layer, expert) pairs: each is a few arena pages, built one by one at start
MAX_EXPERT_PAIRS = 1 << 16
# Floats whose range is narrower than "finite" (every float must be finite): (lowest, highest), both
# allowed. routed_scaling_factor multiplies every routed output (a huge one overflows bf16); DBRX's
# L_p norm of the top-k weights stays in float32's range for p in this range with up to 8192 experts.
FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "routed_scaling_factor": (1e-3, 1e3),
    "topk_norm_p": (0.25, 8.0),
}

# config.json's count and size fields, as each family spells them (at the top level or nested under
# NESTED), -> the ModelSpec field whose bound they share
HF_COUNTS: dict[str, str] = {
    "hidden_size": "hidden_size",
    "d_model": "hidden_size",
    "intermediate_size": "intermediate_size",
    "moe_intermediate_size": "intermediate_size",
    "ffn_hidden_size": "intermediate_size",
    "shared_expert_intermediate_size": "shared_expert_size",
    "num_hidden_layers": "num_layers",
    "n_layers": "num_layers",
    "first_k_dense_replace": "num_layers",
    "decoder_sparse_step": "num_layers",
    "num_attention_heads": "num_heads",
    "n_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "kv_n_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "num_local_experts": "num_experts",
    "num_experts": "num_experts",
    "n_routed_experts": "num_experts",
    "moe_num_experts": "num_experts",
    "n_shared_experts": "num_experts",
    "num_experts_per_tok": "top_k",
    "moe_top_k": "top_k",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
    "original_max_position_embeddings": "max_position_embeddings",
    "max_seq_len": "max_position_embeddings",
    "sliding_window": "sliding_window",
    "n_group": "n_group",
    "topk_group": "topk_group",
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "bos_token_id",  # an id, or a list of ids
}
HF_FLOATS = frozenset(
    {
        "rope_theta",
        "rms_norm_eps",
        "routed_scaling_factor",
        "swiglu_alpha",
        "swiglu_limit",
        "partial_rotary_factor",
        "clip_qkv",
        "moe_normalize_expert_weights",
        "factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
    }
)
HF_FLAGS = frozenset(
    {
        "tie_word_embeddings",
        "norm_topk_prob",
        "attention_bias",
        "qkv_bias",
        "use_qk_norm",
        "use_sliding_window",
        "rope_interleave",
        "truncate",
    }
)
HF_NAMES = frozenset({"model_type", "hidden_act", "dtype", "torch_dtype", "rope_type", "type"})
NESTED = ("rope_parameters", "rope_scaling", "attn_config", "ffn_config")  # objects the readers look into


def check_hf_config(config: object) -> None:
    """Raises ModelSpecError naming the field when config.json's dict holds a value of the wrong type
    (a string, bool or float where a count belongs), a count or size past SIZE_BOUNDS, or a number
    that is not finite (NaN, Infinity); fields the readers do not look at are not judged."""
    if not isinstance(config, dict):
        raise ModelSpecError(f"config.json must be a JSON object, got a {type(config).__name__}")
    _check_object(config, "")
    for key in NESTED:
        inner = config.get(key)
        if inner is not None and not isinstance(inner, dict):
            raise ModelSpecError(f"config.json {key} must be an object, got {inner!r:.80}")
        if inner is not None:
            _check_object(inner, f"{key}.")


def _check_object(obj: dict[str, Any], prefix: str) -> None:
    for key, value in obj.items():
        if value is None:
            continue
        name = f"{prefix}{key}"
        if key in HF_COUNTS:
            for v in value if key == "eos_token_id" and isinstance(value, list) else [value]:
                _check_count(name, v, SIZE_BOUNDS[HF_COUNTS[key]])
        elif key in HF_FLOATS:
            if not _finite(value):
                raise ModelSpecError(f"config.json {name} must be a finite number, got {value!r:.80}")
        elif key in HF_FLAGS and not isinstance(value, bool):
            raise ModelSpecError(f"config.json {name} must be true or false, got {value!r:.80}")
        elif key in HF_NAMES and not isinstance(value, str):
            raise ModelSpecError(f"config.json {name} must be a string, got {value!r:.80}")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ModelSpecError(f"config.json {name} must be a finite number, got {value!r}")


def _check_count(name: str, value: object, bound: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelSpecError(f"config.json {name} must be an integer, got {value!r:.80}")
    if value > bound:
        raise ModelSpecError(f"config.json {name} = {value} is more than moe-lightning serves (at most {bound:,})")


def _finite(value: object) -> bool:
    """A number (not a bool) that is neither NaN nor infinite, nor an integer past float's range."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer literal of 400 digits
        return False


def check_spec(spec: ModelSpec) -> None:
    """Raises ModelSpecError naming the field when a ModelSpec field has the wrong type, a count or
    size past SIZE_BOUNDS, a float that is not finite or outside FLOAT_RANGES, or the model more
    (layer, expert) pairs than MAX_EXPERT_PAIRS. Runs first in ModelSpec's own checks."""
    for f in fields(spec):
        _check_field(f.name, getattr(spec, f.name), str(f.type))
    if spec.yarn is not None:
        _check_yarn(spec)
    pairs = (spec.num_layers - len(spec.dense_layers)) * spec.num_experts
    if pairs > MAX_EXPERT_PAIRS:
        raise ModelSpecError(
            f"{spec.num_layers} layers of {spec.num_experts} experts are {pairs:,} (layer, expert) pairs, more "
            f"than moe-lightning serves (at most {MAX_EXPERT_PAIRS:,})"
        )


def _check_field(name: str, value: object, kind: str) -> None:
    """One field by its annotation: `int`, `float`, `bool` (with `| None`: or None) are checked; tuples
    of ids by their elements."""
    if value is None and "None" in kind:
        return
    if kind.startswith("int"):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ModelSpecError(f"{name} must be an integer, got {value!r:.80}")
        if name in SIZE_BOUNDS and value > SIZE_BOUNDS[name]:
            raise ModelSpecError(f"{name} = {value} is more than moe-lightning serves (at most {SIZE_BOUNDS[name]:,})")
    elif kind.startswith("float"):
        if not _finite(value):
            raise ModelSpecError(f"{name} must be a finite number, got {value!r:.80}")
        low, high = FLOAT_RANGES.get(name, (-math.inf, math.inf))
        if not low <= value <= high:  # type: ignore[operator]
            raise ModelSpecError(f"{name} must be in [{low:g}, {high:g}], got {value!r}")
    elif kind.startswith("bool") and not isinstance(value, bool):
        raise ModelSpecError(f"{name} must be true or false, got {value!r:.80}")
    elif kind.startswith("tuple[int") and (
        not isinstance(value, tuple) or any(not isinstance(v, int) or isinstance(v, bool) for v in value)
    ):
        raise ModelSpecError(f"{name} must be a list of integers, got {value!r:.80}")


def _check_yarn(spec: ModelSpec) -> None:
    """YaRN's fields, named as rope_parameters spells them: a factor or beta of 0 divides by zero in the
    frequencies, and a rope_theta of 1 in their correction range (log 1 = 0)."""
    yarn = spec.yarn
    assert yarn is not None
    for f in fields(yarn):
        _check_field(f"rope_parameters.{f.name}", getattr(yarn, f.name), str(f.type))
    for name in ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings"):
        if not getattr(yarn, name) > 0:
            raise ModelSpecError(f"rope_parameters.{name} must be positive, got {getattr(yarn, name)!r}")
    if yarn.attention_factor is not None and not yarn.attention_factor > 0:
        raise ModelSpecError(f"rope_parameters.attention_factor must be positive or null, got {yarn.attention_factor}")
    if yarn.original_max_position_embeddings > SIZE_BOUNDS["max_position_embeddings"]:
        bound = SIZE_BOUNDS["max_position_embeddings"]
        raise ModelSpecError(f"rope_parameters.original_max_position_embeddings is more than {bound:,}")
    if spec.rope_theta == 1:
        raise ModelSpecError("rope_theta must not be 1 with YaRN (its correction range divides by log rope_theta)")


# The fewest bits a stored parameter takes in any checkpoint we load (GPTQ int4, MXFP4 at 4.25)
MIN_BITS_PER_PARAMETER = 4
# the fields a layout's bytes grow with, named when they outgrow the checkpoint
_SHAPE_FIELDS = ("num_layers", "num_experts", "hidden_size", "intermediate_size", "vocab_size", "head_dim")


def check_checkpoint_holds(spec: ModelSpec, model_dir: Path) -> None:
    """Raises ModelSpecError when config.json describes more parameters than the checkpoint's files
    could hold even at 4 bits each: a count or size that does not match the weights, refused before a
    layout of pages (or an arena of that many bytes) is built. Only file sizes are read; a directory
    without safetensors files passes here, and the load names what is missing."""
    try:
        files = checkpoint_files(Path(model_dir))
    except CheckpointError:
        return
    held = sum(f.stat().st_size for f in files)
    params = spec.num_parameters()
    needed = params * MIN_BITS_PER_PARAMETER // 8
    if needed > held:
        shape = ", ".join(f"{name} {getattr(spec, name):,}" for name in _SHAPE_FIELDS)
        raise ModelSpecError(
            f"config.json describes {params:,} parameters ({shape}), at least {format_size(needed)} at "
            f"{MIN_BITS_PER_PARAMETER} bits each, but the checkpoint's files in {model_dir} hold "
            f"{format_size(held)}: a count or size in config.json does not match its weights"
        )
