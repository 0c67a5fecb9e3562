"""A config.json is checked before anything is built from it (issue 54, items 2 and 5): counts and
sizes bounded, values of the wrong type refused, every number finite, floats in the ranges that keep
the arithmetic finite, a config that is not a JSON object (or is nested 100,000 deep) an error rather
than a traceback, and a layout larger than the checkpoint's files could hold refused by `up`'s checks
in under a second, naming the field, before a layout of pages is built."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from moe_lightning.config.checks import check_stack
from moe_lightning.config.stack import StackConfig
from moe_lightning.demo_model import demo_config
from moe_lightning.spec import ModelSpec, ModelSpecError

TINY = {"mixtral": demo_config("tiny"), **{a: demo_config("tiny", arch=a) for a in ("gpt-oss", "deepseek-v3", "dbrx")}}


def _with(arch: str, change: dict[str, Any]) -> dict[str, Any]:
    config = json.loads(json.dumps(TINY[arch]))
    for key, value in change.items():
        if "." in key:  # nested: rope_parameters.factor
            outer, inner = key.split(".")
            config[outer][inner] = value
        else:
            config[key] = value
    return config


@pytest.mark.parametrize(
    ("arch", "change", "message"),
    [
        # counts and sizes that would have `up` build a page per expert for minutes, or allocate terabytes
        ("mixtral", {"num_local_experts": 10**9}, "num_local_experts = 1000000000 is more than moe-lightning serves"),
        ("mixtral", {"num_hidden_layers": 10**9}, "num_hidden_layers = 1000000000 is more than"),
        ("mixtral", {"hidden_size": 10**7}, "hidden_size = 10000000 is more than"),
        ("mixtral", {"vocab_size": 10**9}, "vocab_size = 1000000000 is more than"),
        ("mixtral", {"max_position_embeddings": 10**12}, "max_position_embeddings = 1000000000000 is more than"),
        (
            "mixtral",
            {"num_hidden_layers": 1000, "num_local_experts": 8192},
            r"8,192,000 \(layer, expert\) pairs, more than",
        ),
        ("dbrx", {"ffn_config.moe_num_experts": 10**6}, "ffn_config.moe_num_experts = 1000000 is more than"),
        # the wrong type, which int() / bool() would have taken
        ("mixtral", {"hidden_size": "64"}, "hidden_size must be an integer, got '64'"),
        ("mixtral", {"num_hidden_layers": True}, "num_hidden_layers must be an integer, got True"),
        ("mixtral", {"intermediate_size": 128.5}, "intermediate_size must be an integer, got 128.5"),
        ("mixtral", {"eos_token_id": [2, "3"]}, "eos_token_id must be an integer, got '3'"),
        ("mixtral", {"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
        ("mixtral", {"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a finite number"),
        ("mixtral", {"dtype": ["float32"]}, "dtype must be a string"),
        # numbers that are not finite, and floats that make the arithmetic so
        ("mixtral", {"rope_theta": math.inf}, "rope_theta must be a finite number, got inf"),
        ("mixtral", {"rms_norm_eps": math.nan}, "rms_norm_eps must be a finite number, got nan"),
        ("mixtral", {"rope_theta": 10**400}, "rope_theta must be a finite number"),
        ("deepseek-v3", {"routed_scaling_factor": math.inf}, "routed_scaling_factor must be a finite number"),
        ("deepseek-v3", {"routed_scaling_factor": 1e30}, r"routed_scaling_factor must be in \[0.001, 1000\]"),
        ("gpt-oss", {"rope_parameters.factor": 0}, "rope_parameters.factor must be positive, got 0.0"),
        ("gpt-oss", {"rope_parameters.factor": -4.0}, "rope_parameters.factor must be positive"),
        ("gpt-oss", {"rope_parameters.beta_fast": math.inf}, "rope_parameters.beta_fast must be a finite number"),
        ("gpt-oss", {"swiglu_limit": math.inf}, "swiglu_limit must be a finite number"),
        ("dbrx", {"ffn_config.moe_normalize_expert_weights": 1e6}, r"topk_norm_p must be in \[0.25, 8\]"),
    ],
)
def test_a_config_value_out_of_bounds_or_of_the_wrong_type_is_refused_by_name(
    arch: str, change: dict[str, Any], message: str
) -> None:
    t0 = time.perf_counter()
    with pytest.raises(ModelSpecError, match=message):
        ModelSpec.from_hf_config(_with(arch, change))
    assert time.perf_counter() - t0 < 1.0


def test_the_bounds_admit_every_published_shape() -> None:
    from moe_lightning.families import plan_presets

    for name, spec in plan_presets().items():
        assert ModelSpec.from_dict(spec.to_dict()) == spec, name


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1, 2]", "must be a JSON object, got a list"),
        ('"mixtral"', "must be a JSON object, got a str"),
        ("[" * 100_000 + "]" * 100_000, "is nested too deeply"),
        ('{"a":' * 100_000 + "1" + "}" * 100_000, "is nested too deeply"),
    ],
)
def test_a_config_that_is_not_an_object_is_an_error_not_a_traceback(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ModelSpecError, match=message):
        ModelSpec.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"num_local_experts": 4096}, "num_experts 4,096"),
        ({"num_hidden_layers": 600}, "num_layers 600"),
        ({"hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8}, "hidden_size 8,192"),
    ],
)
def test_up_refuses_a_layout_larger_than_the_checkpoint_in_under_a_second(
    tiny_model: Path, tmp_path: Path, change: dict[str, int], named: str
) -> None:
    """Plausible sizes, each within the bounds, that the checkpoint's files cannot hold even at 4 bits
    a parameter: refused by the checks `up` runs before it starts anything (and the weight store runs
    again), before a layout of pages or an arena is made."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **change}))
    t0 = time.perf_counter()
    with pytest.raises(ModelSpecError, match=f"{named}.*but the checkpoint's files in .* hold") as refused:
        check_stack(StackConfig(model=model))
    assert time.perf_counter() - t0 < 1.0
    assert "a count or size in config.json does not match its weights" in str(refused.value)
