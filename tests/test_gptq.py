"""4-bit GPTQ checkpoints in their published layout (tests/gptq_writer.py writes them): experts load as
int4 pages equal to the dequantized reference, every other linear dense and equal to it, generation
through the in-process engine matches transformers on the dequantized checkpoint, and what we cannot
run is refused at start with the reason."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from moe_lightning.checkpoint import CheckpointReader, load_model_weights
from moe_lightning.checkpoint_error import CheckpointError
from moe_lightning.demo_model import demo_config, write_demo_model
from moe_lightning.engine import InProcessEngine
from moe_lightning.quant import kernels
from moe_lightning.quant.gptq_config import GPTQConfig, read_gptq_config
from moe_lightning.quant.kernels import QuantizedLinear
from moe_lightning.quant.scheme import QuantFormat, QuantScheme
from moe_lightning.spec import ModelSpec
from moe_lightning.weights import ModelWeights

from gptq_writer import write_gptq
from reference import assert_engine_matches, hf_greedy, load_hf

# widths that group size 128 divides; small otherwise
SHAPES = dict(
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=256,
    max_position_embeddings=256,
)
PROMPTS = [[1, 17, 42, 99, 7, 3, 150, 11, 5], [1, 190], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
STEPS = 8


@pytest.fixture(scope="module")
def mixtral_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("src"), SHAPES, seed=4, progress=False, with_tokenizer=False)


@pytest.fixture
def exact_kernels() -> Iterator[None]:
    kernels.configure("exact")  # the default may round activations to bf16; the reference is fp32
    yield
    kernels.configure()


def _quantized_experts(weights: ModelWeights) -> Iterator[tuple[int, int, QuantizedLinear, QuantizedLinear]]:
    for i, layer in enumerate(weights.layers):
        for e, expert in enumerate(layer.experts):
            assert isinstance(expert.w13, QuantizedLinear) and isinstance(expert.w2, QuantizedLinear)
            yield i, e, expert.w13, expert.w2


def _assert_dense_equal(ours: ModelWeights, ref: ModelWeights) -> None:
    for name in ("embed", "final_norm", "lm_head"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    for i, (a, b) in enumerate(zip(ours.layers, ref.layers, strict=True)):
        got, want = list(a.dense_tensors()), list(b.dense_tensors())
        assert len(got) == len(want)
        for j, (x, y) in enumerate(zip(got, want, strict=True)):
            assert x.dtype == y.dtype and torch.equal(x, y), f"layer {i}: dense tensor {j} differs"


CASES = [(g, desc, sym, "gptq") for g in (128, -1) for desc in (False, True) for sym in (True, False)]
CASES.append((128, True, False, "gptq_v2"))


@pytest.mark.parametrize(("group_size", "desc_act", "sym", "fmt"), CASES)
def test_load_equals_the_dequantized_reference(
    mixtral_src: Path, tmp_path: Path, group_size: int, desc_act: bool, sym: bool, fmt: str
) -> None:
    q, ref = write_gptq(
        mixtral_src,
        tmp_path / "gptq",
        tmp_path / "ref",
        group_size,
        desc_act,
        sym,
        fmt,
        seed=abs(group_size) + 7 * desc_act,
        config_in="config.json" if sym else "quantize_config.json",  # both places AutoGPTQ-era files use
        g_idx_stored=desc_act or sym,  # old checkpoints without act order may omit g_idx
        lm_head=fmt == "gptq_v2",  # GPTQModel's checkpoints may quantize lm_head as well
    )
    config = read_gptq_config(q)
    assert config == GPTQConfig(4, group_size, desc_act, sym, fmt)
    assert config.scheme == QuantScheme(QuantFormat.INT4, group_size, act_order=desc_act)
    spec = ModelSpec.from_pretrained(ref)
    ours = load_model_weights(q, spec, progress=False)
    reference = load_model_weights(ref, spec, progress=False)
    d, inter = spec.hidden_size, spec.intermediate_size
    for i, e, w13, w2 in _quantized_experts(ours):
        want = reference.layers[i].experts[e]
        assert w13.format is QuantFormat.INT4 and w13.qweight.dtype == torch.uint8
        assert w13.device.type == "cpu" and w2.device.type == "cpu"
        assert (w13.group_size, w2.group_size) == ((d, inter) if group_size == -1 else (group_size, group_size))
        assert (w13.perm is not None) == desc_act and (w2.perm is not None) == desc_act
        if desc_act:
            assert w13.perm.shape == (2, d) and w2.perm.shape == (1, inter)
        torch.testing.assert_close(kernels.dequantize(w13), want.w13, rtol=1e-6, atol=0)
        torch.testing.assert_close(kernels.dequantize(w2), want.w2, rtol=1e-6, atol=0)
    _assert_dense_equal(ours, reference)
    if fmt == "gptq_v2":
        assert "lm_head.qweight" in CheckpointReader(q)
    assert ours.nbytes() < reference.nbytes() / 2  # the experts' int4 pages are what nbytes counts


QWEN = dict(SHAPES, num_hidden_layers=2, mlp_only_layers=[1])  # layer 1 dense: its MLP is quantized too
E2E = {  # family -> (preset, group size, desc_act, sym)
    "mixtral": (SHAPES, 128, True, False),
    "qwen2-moe": (QWEN, -1, True, True),
    "olmoe": (SHAPES, 128, False, True),
    "qwen3-moe": (SHAPES, 64, True, False),
}


@pytest.mark.parametrize("arch", list(E2E))
def test_generation_matches_transformers_on_the_dequantized_checkpoint(
    arch: str, tmp_path: Path, exact_kernels: None
) -> None:
    preset, group_size, desc_act, sym = E2E[arch]
    src = write_demo_model(tmp_path / "src", preset, seed=2, progress=False, with_tokenizer=False, arch=arch)
    q, ref = write_gptq(src, tmp_path / "gptq", tmp_path / "ref", group_size, desc_act, sym, seed=5)
    spec = ModelSpec.from_pretrained(q)
    weights = load_model_weights(q, spec, progress=False)
    assert len(list(_quantized_experts(weights))) == spec.num_experts * spec.num_sparse_layers
    if arch == "qwen2-moe":  # the shared expert and the dense layer's MLP come out dense, as dequantized
        _assert_dense_equal(weights, load_model_weights(ref, spec, progress=False))
    hf = load_hf(ref)
    reference = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    assert_engine_matches(InProcessEngine(spec, weights, block_size=4), PROMPTS, STEPS, reference)


def _config_dir(tmp_path: Path, config: dict[str, Any], quantization: dict[str, Any] | None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    if quantization is not None:
        config = {**config, "quantization_config": quantization}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


GPTQ = dict(quant_method="gptq", bits=4, group_size=128, desc_act=False, sym=True)


@pytest.mark.parametrize(
    ("arch", "quantization", "message"),
    [
        ("mixtral", GPTQ | {"bits": 8}, "bits=8"),
        ("mixtral", {"quant_method": "awq", "bits": 4, "group_size": 128}, "'awq' is not supported"),
        ("mixtral", {"quant_method": "fp8"}, "'fp8' is not supported"),
        ("mixtral", GPTQ | {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ("mixtral", GPTQ | {"is_marlin_format": True}, "checkpoint_format 'marlin'"),
        ("mixtral", GPTQ | {"desc_act": "yes"}, "desc_act must be bool"),
        ("mixtral", {"bits": 4}, "no quant_method"),
        ("dbrx", GPTQ, "DBRX"),
    ],
)
def test_what_we_cannot_run_is_named(tmp_path: Path, arch: str, quantization: dict, message: str) -> None:
    d = _config_dir(tmp_path, demo_config("tiny", arch=arch), quantization)
    with pytest.raises(CheckpointError, match=message) as err:
        read_gptq_config(d)
    if quantization.get("quant_method") not in (None, "gptq"):
        assert "gptq" in str(err.value)  # says what we do load


def test_refused_at_start_and_unquantized_unchanged(mixtral_src: Path, tmp_path: Path) -> None:
    assert read_gptq_config(mixtral_src) is None
    assert CheckpointReader(mixtral_src).gptq is None
    q, _ = write_gptq(mixtral_src, tmp_path / "gptq", tmp_path / "ref")
    config = json.loads((q / "config.json").read_text())
    config["quantization_config"]["bits"] = 8
    (q / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="bits=8"):
        load_model_weights(q, ModelSpec.from_pretrained(q), progress=False)


def test_an_act_order_the_config_does_not_declare_is_an_error(mixtral_src: Path, tmp_path: Path) -> None:
    q, _ = write_gptq(mixtral_src, tmp_path / "gptq", tmp_path / "ref", desc_act=True)
    config = json.loads((q / "config.json").read_text())
    config["quantization_config"]["desc_act"] = False
    (q / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="activation order"):
        load_model_weights(q, ModelSpec.from_pretrained(q), progress=False, layers=[0])
