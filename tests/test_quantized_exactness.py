"""Quantized experts (int8 per channel, int4 group-wise) against transformers running the
dequantized weights, for every family: in process, a ragged batch, prefill + 16 greedy decode
steps, logits within 1e-4 x max(1, max|logit|) and identical tokens, with the kernels restricted to
those computing in the weights' dtype (`--expert-kernels exact`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from moe_lightning.arena import ArenaLayout, fill_arena, weights_from_arena
from moe_lightning.engine import InProcessEngine
from moe_lightning.quant import kernels
from moe_lightning.quant.kernels import QuantizedLinear
from moe_lightning.quant.scheme import QuantFormat, QuantScheme
from moe_lightning.spec import ModelSpec

from quantized_reference import write_dequantized
from reference import E2E_CONFIG, assert_engine_matches, hf_greedy, load_hf, save_hf
from test_families import CONFIGS, PROMPTS, STEPS

SCHEMES = {"int8": QuantScheme(QuantFormat.INT8), "int4-g8": QuantScheme(QuantFormat.INT4, 8)}
FAMILIES = {"mixtral": ("mixtral", E2E_CONFIG), **CONFIGS}


@pytest.fixture(autouse=True)
def exact_kernels() -> Iterator[None]:
    kernels.configure("exact")
    yield
    kernels.configure()


def quantized_weights(model: Path, scheme: QuantScheme) -> tuple[ModelSpec, object]:
    spec = ModelSpec.from_pretrained(model)
    layout = ArenaLayout.for_spec(spec, "float32", scheme)
    arena = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    fill_arena(arena, layout, model, spec, progress=False)
    return spec, weights_from_arena(arena, layout, spec)


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_quantized_experts_match_transformers_on_the_dequantized_weights(
    family: str, scheme: str, tmp_path: Path
) -> None:
    arch, overrides = FAMILIES[family]
    model = save_hf(arch, tmp_path / "model", seed=3, **overrides)
    spec, weights = quantized_weights(model, SCHEMES[scheme])
    sparse = spec.experts_per_layer.index(spec.num_experts)
    assert isinstance(weights.layers[sparse].experts[0].w13, QuantizedLinear)
    hf = load_hf(write_dequantized(model, tmp_path / "dequantized", SCHEMES[scheme], spec.num_experts))
    reference = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    assert_engine_matches(InProcessEngine(spec, weights, block_size=4), PROMPTS, STEPS, reference)
