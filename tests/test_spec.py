from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_lightning.demo_model import PRESETS, mixtral_config
from moe_lightning.spec import ModelSpec, ModelSpecError


def test_parses_demo_presets() -> None:
    spec = ModelSpec.from_hf_config(mixtral_config("bench"))
    assert (spec.hidden_size, spec.intermediate_size, spec.num_layers) == (1024, 3584, 8)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (16, 4, 64)
    assert (spec.num_experts, spec.top_k, spec.vocab_size) == (8, 2, 32000)
    assert 0.75e9 < spec.num_parameters() < 0.85e9  # "~0.8 B parameters"
    assert ModelSpec.from_hf_config(mixtral_config("tiny")).num_parameters() < 2e6
    assert set(PRESETS) >= {"tiny", "bench"}


def test_released_mixtral_config_shape() -> None:
    """The field set of mistralai/Mixtral-8x7B-v0.1's config.json (top-level rope_theta, bf16)."""
    config = {
        "architectures": ["MixtralForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "rope_theta": 1e6,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "max_position_embeddings": 32768,
        "sliding_window": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    spec = ModelSpec.from_hf_config(config)
    assert spec.head_dim == 128 and spec.dtype == "bfloat16" and spec.rope_theta == 1e6
    assert 46e9 < spec.num_parameters() < 47.5e9  # Mixtral 8x7B: 46.7 B


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, "architectures\\[0\\] = 'LlamaForCausalLM' is not supported"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok \\(9\\) cannot exceed"),
        ({"hidden_size": None}, "missing required field 'hidden_size'"),
        ({"num_local_experts": 0}, "num_experts must be a positive integer"),
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported"),
        ({"dtype": "float8"}, "dtype 'float8' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type = 'yarn' is not supported"),
        ({"eos_token_id": 99999}, "special token id 99999 is outside the vocabulary"),
    ],
)
def test_inconsistent_configs_name_the_field(change: dict, message: str) -> None:
    config = mixtral_config("tiny")
    config.update(change)
    with pytest.raises(ModelSpecError, match=message):
        ModelSpec.from_hf_config(config)


def test_missing_or_broken_config_file(tmp_path: Path) -> None:
    with pytest.raises(ModelSpecError, match="config.json not found"):
        ModelSpec.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelSpecError, match="not valid JSON"):
        ModelSpec.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelSpecError, match="model_type 'gpt2' is not supported"):
        ModelSpec.from_pretrained(tmp_path)


@pytest.mark.parametrize("arch", ["qwen2-moe", "qwen3-moe"])
def test_qwen_dense_layers_follow_transformers_rule(arch: str) -> None:
    """Sparse unless in mlp_only_layers or (i + 1) % decoder_sparse_step != 0; the dense layers'
    MLP is intermediate_size wide (the experts are moe_intermediate_size)."""
    from moe_lightning.demo_model import demo_config

    config = demo_config("tiny", arch) | {"num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    spec = ModelSpec.from_hf_config(config)
    assert spec.dense_layers == (0, 2, 3, 4)
    assert spec.experts_per_layer == (0, 4, 0, 0, 0, 4) and spec.total_experts == 8
    assert spec.dense_intermediate_size == config["intermediate_size"] != spec.intermediate_size
    sparse = ModelSpec.from_hf_config(demo_config("tiny", arch))
    assert sparse.dense_layers == () and sparse.dense_intermediate_size == 0
    for change, message in [
        ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer, got 0"),
        ({"mlp_only_layers": [7]}, "mlp_only_layers must list layer indices in 0..1, got \\[7\\]"),
        ({"mlp_only_layers": [0, 1]}, "every layer of this .* is dense"),
        ({"decoder_sparse_step": 3}, "every layer of this .* is dense"),
    ]:
        with pytest.raises(ModelSpecError, match=message):
            ModelSpec.from_hf_config(demo_config("tiny", arch) | change)


def test_dtype_auto_is_float32_on_a_cpu_and_16_bit_on_an_accelerator(tiny_model: Path) -> None:
    from moe_lightning.config.stack import StackConfig
    from moe_lightning.launcher import Stack
    from moe_lightning.spec import resolve_dtype

    assert resolve_dtype("auto", "bfloat16", "cpu") == "float32"  # bf16 matmuls are emulated on CPUs
    assert resolve_dtype("auto", "bfloat16", "cuda") == "bfloat16"
    assert resolve_dtype("auto", "float16", "cuda:1") == "float16"
    assert resolve_dtype("auto", "float32", "cuda") == "bfloat16"  # fp32 would stream twice the bytes
    assert resolve_dtype("float16", "bfloat16", "cpu") == "float16"  # asked for: kept
    with pytest.raises(ValueError, match="auto, float32"):
        resolve_dtype("int8", "bfloat16", "cuda")
    # `up` resolves it for the weight store, which cannot know gpu_expert's device
    assert Stack(StackConfig(model=tiny_model, device="cuda")).weight_dtype() == "bfloat16"
    assert Stack(StackConfig(model=tiny_model, device="cpu")).weight_dtype() == "float32"
