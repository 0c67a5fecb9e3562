"""A checkpoint's values are checked as it loads (issue 54, item 2): a weight holding NaN or an
infinity, or MXFP4 scales that dequantize to no finite value (255, NaN in e8m0; 253-254 over a block's
largest values), are refused naming the file and the tensor, in the one pass that converts the weights
(no second read of the model); a weight store given such a checkpoint, or a config.json whose sizes
its files cannot hold, exits 1 saying which and leaves nothing in /dev/shm."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_gpt_oss_mxfp4 import to_published

from moe_lightning.checkpoint import load_model_weights
from moe_lightning.checkpoint_error import CheckpointError
from moe_lightning.demo_model import write_demo_model
from moe_lightning.shm.segment import list_segments
from moe_lightning.spec import ModelSpec

from processes import run_weight_store

EXPERT = "model.layers.1.block_sparse_moe.experts.2.w2.weight"  # the tiny Mixtral's names


def _damaged(src: Path, dst: Path, name: str, change: Callable[[torch.Tensor], None]) -> Path:
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    change(sd[name])
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _element(value: float, at: int = 5) -> Callable[[torch.Tensor], None]:
    return lambda t: t.view(-1).__setitem__(at, value)


@pytest.mark.parametrize(
    ("name", "value", "what"),
    [(EXPERT, float("nan"), "1 NaN and 0 infinite"), ("lm_head.weight", float("-inf"), "0 NaN and 1 infinite")],
)
def test_a_non_finite_weight_is_refused_naming_the_tensor(
    tiny_model: Path, tmp_path: Path, name: str, value: float, what: str
) -> None:
    bad = _damaged(tiny_model, tmp_path / "bad", name, _element(value, at=77))
    with pytest.raises(
        CheckpointError,
        match=f"bad/model.safetensors: tensor '{name}' holds non-finite values \\(from element 77: {what}",
    ):
        load_model_weights(bad, ModelSpec.from_pretrained(bad), progress=False)


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-OSS with its experts in MXFP4, as the published checkpoints hold them."""
    root = tmp_path_factory.mktemp("mxfp4_values")
    return to_published(write_demo_model(root / "dense", "tiny", progress=False, arch="gpt-oss"), root / "published")


SCALES = "model.layers.0.mlp.experts.down_proj_scales"


def _scale(value: int) -> Callable[[torch.Tensor], None]:
    """Block 0 of expert 0's row 3 under scale `value`."""
    return lambda t: t[0, 3].__setitem__(0, value)


def test_mxfp4_scales_that_dequantize_to_no_finite_value_are_refused(published: Path, tmp_path: Path) -> None:
    spec = ModelSpec.from_pretrained(published)
    load_model_weights(published, spec, progress=False)  # as published: loads
    bad = _damaged(published, tmp_path / "nan", SCALES, _scale(255))
    with pytest.raises(
        CheckpointError,
        match=f"nan/model.safetensors: tensor '{SCALES}' holds 1 scale\\(s\\) of 255, which is NaN in e8m0",
    ):
        load_model_weights(bad, spec, progress=False)
    # 254 = 2^127: a block with a 2.0 or larger (nibble 4..7) passes float32's range
    blocks = SCALES.replace("_scales", "_blocks")
    over = _damaged(published, tmp_path / "over", SCALES, _scale(254))
    sd = load_file(over / "model.safetensors")
    sd[blocks][0, 3, 0, 0] = 0x07  # 6.0 * 2^127
    save_file(sd, over / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=f"over/model.safetensors: tensor '{SCALES}' holds scales of 253-254 on blocks"
    ):
        load_model_weights(over, spec, progress=False)


def test_scale_problem_matches_what_dequantization_gives() -> None:
    """Every (scale, byte) pair: a problem is named exactly when the dequantized values are not finite
    (or the scale is e8m0's NaN)."""
    from moe_lightning.quant.mxfp4 import dequantize_mxfp4, scale_problem

    for scale in (0, 127, 252, 253, 254, 255):
        for byte in range(256):
            q = torch.full((1, 16), byte, dtype=torch.uint8)
            s = torch.full((1, 1), scale, dtype=torch.uint8)
            finite = bool(torch.isfinite(dequantize_mxfp4(q, s)).all()) and scale != 255
            assert (scale_problem(q, s) is None) == finite, (scale, byte)


def _too_large_config(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "num_local_experts": 4096}))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda s, d: _damaged(s, d, EXPERT, _element(float("nan"))), f"tensor '{EXPERT}' holds non-finite values"),
        (_too_large_config, "num_experts 4,096.*does not match its weights"),
    ],
    ids=["nan-expert", "config-past-the-files"],
)
def test_the_weight_store_exits_naming_the_tensor_or_field_and_leaves_nothing(
    tiny_model: Path, tmp_path: Path, damage: Callable[[Path, Path], object], message: str
) -> None:
    bad = tmp_path / "bad"
    damage(tiny_model, bad)
    run = f"wsval{os.getpid()}{len(message)}"
    r = run_weight_store(bad, run, tmp_path / "v.sock", timeout=60)
    assert r.returncode == 1, r.stderr[-2000:]
    assert re.search(message, r.stderr), r.stderr[-2000:]
    assert list_segments(run) == []
