"""The compute roof of decode on this machine: what a 2048^3 fp32 GEMM reaches here, divided by the
FLOPs one token costs (2 per weight it multiplies by). Attention over the KV cache is left out: at
these contexts it is a few % of a token's FLOPs, and leaving it out only raises the roof."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_lightning.spec import ModelSpec

GEMM_SIZE = 2048


def active_parameters(spec: ModelSpec) -> dict[str, int]:
    """Weights one token multiplies by, counted from the model's spec (its config.json): every layer's
    attention projections; the router and the top-k experts (and a shared expert) of each sparse layer,
    a dense layer's MLP; the LM head. The embedding is a lookup, not a product."""
    d = spec.hidden_size
    sparse = spec.num_sparse_layers
    return {
        "attention": spec.num_layers * spec.attention_params(),
        "router": sparse * spec.num_experts * d,
        "experts": sparse * (spec.top_k * spec.expert_params() + 3 * d * spec.shared_expert_size)
        + len(spec.dense_layers) * 3 * d * spec.dense_intermediate_size,
        "lm_head": spec.vocab_size * d,
    }


def active_parameters_of(model: Path) -> dict[str, int]:
    from moe_lightning.spec import ModelSpec

    return active_parameters(ModelSpec.from_pretrained(model))


def roof_tokens_per_second(gflops: float, params: dict[str, int]) -> float:
    """Tokens per second if every active weight's multiply-add ran at `gflops`."""
    return gflops * 1e9 / (2 * sum(params.values()))


def gemm_gflops(threads: int, size: int = GEMM_SIZE, repeats: int = 5) -> float:
    """The best of `repeats` fp32 (size x size) @ (size x size) products with torch on `threads`
    threads, in GFLOP/s (the best: the roof is what the cores can do, not what a busy moment gave)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
        out = torch.empty(size, size)
        torch.mm(a, b, out=out)  # warm-up: the library's first call sets up its threads and buffers
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return 2 * size**3 / best / 1e9
