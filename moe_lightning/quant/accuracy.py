"""What quantizing the experts costs in accuracy: each format against the model's own dtype on one
fixed text, teacher forced (every format sees the same tokens, so one early difference does not
decide every later one): perplexity, the logit error at each position, and how often the most
likely next token is the same. `bench/quant_accuracy.py` prints it; a test bounds it
(docs/quantization.md has the numbers and the limits)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_lightning.arena import ArenaLayout, fill_arena, weights_from_arena
from moe_lightning.engine import forward_step
from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.quant.scheme import QuantScheme
from moe_lightning.spec import ModelSpec
from moe_lightning.weights import ModelWeights

TEXT_SEED = 11  # the demo models' pseudo-language, lines their tokenizer was not trained on
TEXT_LINES = 40


def fixed_text() -> str:
    from moe_lightning.demo_model import _corpus

    return " ".join(_corpus(TEXT_SEED, 2000)[:TEXT_LINES])


@dataclass(frozen=True, slots=True)
class Accuracy:
    format: str
    perplexity: float
    max_logit_error: float  # the largest, over positions, of max|logit - ref| / max(1, max|ref|)
    mean_logit_error: float  # the same, averaged over positions
    top1_agreement: float  # positions whose most likely next token is the reference's


def arena_weights(model_dir: Path, spec: ModelSpec, scheme: QuantScheme) -> ModelWeights:
    """The model as the services would map it, experts in `scheme`'s format (fp32 otherwise)."""
    layout = ArenaLayout.for_spec(spec, "float32", scheme)
    arena = torch.empty(layout.total_bytes, dtype=torch.uint8)
    fill_arena(arena, layout, model_dir, spec, progress=False)
    return weights_from_arena(arena, layout, spec)


@torch.inference_mode()
def text_logits(spec: ModelSpec, weights: ModelWeights, tokens: list[int]) -> torch.Tensor:
    """(T,) tokens of one sequence -> (T, V) logits of the token after each."""
    block = 16
    cache = PagedKVCache(spec, -(-len(tokens) // block), block, weights.embed.dtype)
    meta = cache.append([0], [len(tokens)])
    return forward_step(spec, weights, cache, torch.tensor(tokens), meta, every_position=True).float()


def perplexity(logits: torch.Tensor, tokens: list[int]) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(tokens[1:]))
    return math.exp(nll.item())


def compare(reference: torch.Tensor, logits: torch.Tensor, tokens: list[int], name: str) -> Accuracy:
    scale = reference.abs().amax(dim=-1).clamp(min=1.0)  # (T,)
    err = (logits - reference).abs().amax(dim=-1) / scale  # (T,)
    agree = (logits.argmax(dim=-1) == reference.argmax(dim=-1)).float().mean().item()
    return Accuracy(name, perplexity(logits, tokens), err.max().item(), err.mean().item(), agree)


def measure(model_dir: Path, schemes: list[QuantScheme], tokens: list[int]) -> list[Accuracy]:
    """The unquantized model first (its errors are zero by definition), then each scheme."""
    spec = ModelSpec.from_pretrained(model_dir)
    reference = text_logits(spec, arena_weights(model_dir, spec, QuantScheme()), tokens)
    out = [compare(reference, reference, tokens, "float32")]
    for scheme in schemes:
        out.append(
            compare(reference, text_logits(spec, arena_weights(model_dir, spec, scheme), tokens), tokens, scheme.key())
        )
    return out
