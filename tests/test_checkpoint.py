"""Checkpoint reading: single file, sharded, fp32/fp16/bf16, and errors that name the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_lightning.checkpoint import CheckpointReader, load_model_weights
from moe_lightning.checkpoint_error import CheckpointError
from moe_lightning.demo_model import write_demo_model
from moe_lightning.spec import ModelSpec

from reference import save_hf_mixtral


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _flat(weights) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    out = [weights.embed, weights.final_norm, weights.lm_head]
    for layer in weights.layers:
        out += list(layer.dense_tensors())
        for e in layer.experts:
            out += list(e.tensors())
    return out


def test_sharded_checkpoint_equals_single_file(tmp_path: Path, tiny_model: Path) -> None:
    from transformers import MixtralForCausalLM

    spec = ModelSpec.from_pretrained(tiny_model)
    model = MixtralForCausalLM.from_pretrained(tiny_model)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    a = load_model_weights(tiny_model, spec, progress=False)
    b = load_model_weights(tmp_path / "sharded", spec, progress=False)
    for x, y in zip(_flat(a), _flat(b), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_host_weights_start_on_cache_lines(tiny_model: Path) -> None:
    """safetensors' views of the file start wherever the header left them (8-byte aligned): loaded for
    the host, every weight is on a 64-byte boundary, or the native GEMMs split each vector load in two."""
    spec = ModelSpec.from_pretrained(tiny_model)
    reader = CheckpointReader(tiny_model)
    o_proj = (spec.hidden_size, spec.q_size)
    as_read = [reader.get(f"model.layers.{i}.self_attn.o_proj.weight", o_proj) for i in range(spec.num_layers)]
    assert any(t.data_ptr() % 64 for t in as_read)  # the file's own views are not aligned: the case is real
    weights = load_model_weights(tiny_model, spec, progress=False)
    loose = [tuple(t.shape) for t in _flat(weights) if isinstance(t, torch.Tensor) and t.data_ptr() % 64]
    assert loose == []
    for i, t in enumerate(as_read):
        torch.testing.assert_close(weights.layers[i].wo, t, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_checkpoints_load_exactly(tmp_path: Path, dtype: str) -> None:
    src = write_demo_model(tmp_path / dtype, "tiny", dtype=dtype, progress=False, with_tokenizer=False)
    spec = ModelSpec.from_pretrained(src)
    assert spec.dtype == dtype
    stored = load_file(str(src / "model.safetensors"))
    w = load_model_weights(src, spec, dtype=torch.float32, progress=False)
    assert w.embed.dtype == torch.float32
    torch.testing.assert_close(w.embed, stored["model.embed_tokens.weight"].float(), rtol=0, atol=0)
    e3 = w.layers[1].experts[3]
    p = "model.layers.1.block_sparse_moe.experts.3"
    inter = spec.intermediate_size
    torch.testing.assert_close(e3.w13[:inter], stored[f"{p}.w1.weight"].float(), rtol=0, atol=0)
    torch.testing.assert_close(e3.w13[inter:], stored[f"{p}.w3.weight"].float(), rtol=0, atol=0)


def test_transformers5_fused_expert_layout_loads(tmp_path: Path) -> None:
    """A checkpoint saved in transformers 5's in-memory layout (gate_up_proj/down_proj) is read too."""
    src = save_hf_mixtral(
        tmp_path / "hf",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=3,
        num_experts_per_tok=2,
    )
    spec = ModelSpec.from_pretrained(src)
    sd = load_file(str(src / "model.safetensors"))
    fused = {k: v for k, v in sd.items() if ".experts." not in k}
    fused = {k.replace("block_sparse_moe.gate", "mlp.gate"): v for k, v in fused.items()}
    p = "model.layers.0.block_sparse_moe.experts"
    fused["model.layers.0.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([sd[f"{p}.{e}.w1.weight"], sd[f"{p}.{e}.w3.weight"]]) for e in range(3)]
    )
    fused["model.layers.0.mlp.experts.down_proj"] = torch.stack([sd[f"{p}.{e}.w2.weight"] for e in range(3)])
    dst = tmp_path / "fused"
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(fused, str(dst / "model.safetensors"))
    a = load_model_weights(src, spec, progress=False)
    b = load_model_weights(dst, spec, progress=False)
    for x, y in zip(_flat(a), _flat(b), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_missing_tensor_names_tensor(tmp_path: Path, tiny_model: Path) -> None:
    d = _copy(tiny_model, tmp_path / "m")
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.layers.1.block_sparse_moe.experts.2.w3.weight' is missing"):
        load_model_weights(d, ModelSpec.from_pretrained(d), progress=False)


def test_wrong_shape_names_tensor_and_file(tmp_path: Path, tiny_model: Path) -> None:
    d = _copy(tiny_model, tmp_path / "m")
    sd = load_file(str(d / "model.safetensors"))
    sd["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(3, 5)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"'model.layers.0.self_attn.o_proj.weight' in model.safetensors has shape \[3, 5\]"
    ):
        load_model_weights(d, ModelSpec.from_pretrained(d), progress=False)


def test_truncated_file_is_reported(tmp_path: Path, tiny_model: Path) -> None:
    d = _copy(tiny_model, tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated safetensors file"):
        CheckpointReader(d)
    f.write_bytes(data[:4])
    with pytest.raises(CheckpointError, match="no header"):
        CheckpointReader(d)


def test_missing_shard_and_missing_weights(tmp_path: Path, tiny_model: Path) -> None:
    d = _copy(tiny_model, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        CheckpointReader(d)
    index = {"weight_map": {"x": "model-00001-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="names shard model-00001-of-00002.safetensors, which does not exist"):
        CheckpointReader(d)


def test_unknown_architecture_is_rejected(tmp_path: Path, tiny_model: Path) -> None:
    from moe_lightning.spec import ModelSpecError

    d = _copy(tiny_model, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelSpecError, match="'FooForCausalLM' is not supported; supported: MixtralForCausalLM"):
        ModelSpec.from_pretrained(d)
