"""How much of the device the weights may take when the operator did not say (--device-memory).

All of the card's memory is too much: the CUDA context and cuBLAS workspaces, the activations of
the largest micro-batch, the head's logits for the whole batch and the warm-up's calibration
buffers need room too, or the first large step fails with an out-of-memory error.
"""

from __future__ import annotations

import os

import torch

from moe_lightning.spec import ModelSpec

RUNTIME_RESERVE = 1 << 30  # cuBLAS/cuDNN workspaces, the allocator's fragmentation, calibration buffers
# under --cap-device-memory, what the allocator needs beside the weights and activations (cuBLAS workspaces,
# fragmentation, calibration buffers): the CUDA context itself is outside the allocator and the cap
CAPPED_WORKSPACE = 512 << 20
HEAD_ROWS = 4096  # sequences the head samples at once (the planner's batch cap)


def activation_bytes(spec: ModelSpec, max_tokens: int, itemsize: int, head: bool = True) -> int:
    """Peak working set of one micro-batch of `max_tokens` tokens plus the head over a full batch:
    hidden states, q/k/v and the attention result, the experts' gate/up and output (top-k copies
    of the tokens), and fp32 logits with the sampler's copies of them."""
    per_token = 6 * spec.hidden_size + 2 * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    per_token += spec.top_k * (3 * spec.intermediate_size + spec.hidden_size)
    logits = 3 * HEAD_ROWS * spec.vocab_size * 4 if head else 0  # only the rank that samples has a head
    return max_tokens * per_token * itemsize + logits


def default_budget(
    device: torch.device, spec: ModelSpec, max_tokens: int, itemsize: int, head: bool = True
) -> tuple[int, int]:
    """(budget for weights and the device KV cache, what was kept back) on `device`. `spec`: the
    rank's part of the model; `head`: whether this rank samples."""
    if device.type != "cuda":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), 0
    free, _ = torch.cuda.mem_get_info(device)  # after this process's context exists
    reserve = RUNTIME_RESERVE + activation_bytes(spec, max_tokens, itemsize, head)
    return max(0, free - reserve), reserve


def capped_reserve(spec: ModelSpec, max_tokens: int, itemsize: int, head: bool = True) -> int:
    """What --cap-device-memory keeps back from the weights within the cap: the activations of the largest
    micro-batch and the head, and the allocator's workspace (bench/gpucheck/budget.py sizes a budget with it)."""
    return CAPPED_WORKSPACE + activation_bytes(spec, max_tokens, itemsize, head)


def cap_device_memory(device: torch.device, total: int, reserve: int) -> int:
    """--cap-device-memory: caps the caching allocator at `total` bytes of `device` (all this process
    allocates there: weights, buffers, activations) and returns what the weights may take of it."""
    if device.type == "cuda":
        capacity = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, total / capacity), device)
    return max(0, total - reserve)
