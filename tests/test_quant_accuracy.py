"""A bounded regression on what quantized experts cost on the `bench` model (random weights, 0.8 B
parameters): perplexity of a fixed text, logit error and top-1 agreement against fp32, teacher
forced, with the default (fastest) kernels. The limits are the ones docs/quantization.md states;
a change that makes a format less accurate than that fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_lightning.demo_model import write_demo_model
from moe_lightning.quant.accuracy import fixed_text, measure
from moe_lightning.quant.scheme import QuantFormat, QuantScheme
from moe_lightning.tokenizer import TextTokenizer

TOKENS = 256  # of the fixed text: enough positions for stable means, a few seconds per format
# format -> (largest |perplexity ratio - 1|, largest mean logit error, smallest top-1 agreement)
LIMITS = {"int8": (0.02, 0.08, 0.80), "int4-g128": (0.05, 0.50, 0.25)}


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("bench"), "bench", progress=False)


def test_quantized_experts_stay_within_the_documented_accuracy(bench_model: Path) -> None:
    tok = TextTokenizer.from_model_dir(bench_model)
    assert tok is not None
    tokens = tok.encode(fixed_text())[:TOKENS]
    assert len(tokens) == TOKENS
    schemes = [QuantScheme(QuantFormat.INT8), QuantScheme(QuantFormat.INT4, 128)]
    reference, *quantized = measure(bench_model, schemes, tokens)
    assert reference.max_logit_error == 0 and reference.top1_agreement == 1
    for row in quantized:
        ppl, err, agree = LIMITS[row.format]
        assert abs(row.perplexity / reference.perplexity - 1) <= ppl, row
        assert row.mean_logit_error <= err, row
        assert row.top1_agreement >= agree, row
    int8, int4 = quantized
    assert int8.mean_logit_error < int4.mean_logit_error  # more bits, closer to fp32
