"""--quantize-dense (moe_lightning/quant/dense.py) on a model's weights as gpu_expert maps them: which
weights it replaces, the bytes it saves, a rank that does not sample, and rows quantized in chunks
equal to all at once. Exactness through the stack: tests/test_quantized_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_tensor_parallel import arena_weights

from moe_lightning.quant.dense import quantize_dense, quantize_rows
from moe_lightning.quant.kernels import QuantizedLinear
from moe_lightning.quant.rtn import quantize
from moe_lightning.quant.scheme import QuantFormat, QuantScheme
from moe_lightning.spec import ModelSpec

from reference import save_hf
from tp_configs import TP_FAMILIES


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, config = TP_FAMILIES["mixtral"]
    return save_hf(arch, tmp_path_factory.mktemp("dense") / "m", seed=3, **config)


def test_projections_and_head_become_int8_and_the_rest_stays(model: Path) -> None:
    spec = ModelSpec.from_pretrained(model)
    (weights,) = arena_weights(model, 1)
    router, embed = weights.layers[0].router, weights.embed
    want = quantize(weights.lm_head, QuantScheme(QuantFormat.INT8)).dequantize()
    d, v = spec.hidden_size, spec.vocab_size
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    projections = spec.num_layers * (qkv * d + d * spec.num_heads * spec.head_dim)
    saved = quantize_dense(weights, "int8")
    rows = spec.num_layers * (qkv + d) + v  # one fp32 scale per output row
    assert saved == (projections + v * d) * 3 - rows * 4  # fp32 -> int8 and its scales
    for layer in weights.layers:
        assert isinstance(layer.wqkv, QuantizedLinear) and isinstance(layer.wo, QuantizedLinear)
        assert layer.wqkv.format is QuantFormat.INT8 and layer.wo.shape == (d, spec.num_heads * spec.head_dim)
    assert isinstance(weights.lm_head, QuantizedLinear)
    torch.testing.assert_close(weights.lm_head.dequantize(), want, rtol=0, atol=0)
    assert weights.layers[0].router is router and weights.embed is embed  # the router picks experts: kept
    assert quantize_dense(weights, "int8") == 0  # already quantized: nothing to do
    (untouched,) = arena_weights(model, 1)
    assert quantize_dense(untouched, "none") == 0 and isinstance(untouched.lm_head, torch.Tensor)


def test_a_rank_that_does_not_sample_keeps_its_empty_head(model: Path) -> None:
    _, second = arena_weights(model, 2)
    assert second.lm_head.numel() == 0
    assert quantize_dense(second, "int8") > 0
    assert isinstance(second.lm_head, torch.Tensor) and isinstance(second.layers[0].wo, QuantizedLinear)


def test_rows_quantized_in_chunks_equal_all_at_once() -> None:
    w = torch.randn(1000, 64, dtype=torch.bfloat16)
    whole = quantize(w, QuantScheme(QuantFormat.INT8))
    chunked = quantize_rows(w, QuantScheme(QuantFormat.INT8), rows=96)  # 1000 = 10 x 96 + 40
    assert torch.equal(chunked.qweight, whole.qweight) and torch.equal(chunked.scales, whole.scales)
