"""Baseline: transformers' generate with accelerate offloading the layers that do not fit the GPU."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from moe_lightning.benchmark import left_pad


def _dtype_kwarg() -> str:
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # `dtype` replaced `torch_dtype` in 4.56


def _generate_chunks(
    model: Any, prompts: list[list[int]], gen_len: int, batch: int, device: torch.device, deadline: float
) -> tuple[float, int, int, int]:
    """Greedy generate over `prompts` in chunks of `batch`, left padded per chunk, until the prompts
    run out or the next chunk would end past `deadline` (perf_counter; one chunk always runs: its
    throughput is the baseline's, the chunks after it only repeat it); returns (seconds, generated
    tokens, padded prompt tokens, prompts run)."""
    generated = padded = ran = 0
    wall = last = 0.0
    for start in range(0, len(prompts), batch):
        if ran and time.perf_counter() + last > deadline:
            break
        chunk = prompts[start : start + batch]
        ids, mask = left_pad(chunk, device)
        width = ids.shape[1]
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=gen_len,
                min_new_tokens=gen_len,
                do_sample=False,
                pad_token_id=0,
            )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        last = time.perf_counter() - t0
        wall += last
        generated += (out.shape[1] - width) * len(chunk)
        padded += width * len(chunk)
        ran += len(chunk)
        del out
    return wall, generated, padded, ran


def transformers_offload_generate(
    model_dir: Path,
    prompts: list[list[int]],
    gen_len: int,
    max_memory_bytes: int,
    dtype: torch.dtype = torch.bfloat16,
    total_memory_bytes: int | None = None,
    deadline: float = float("inf"),
) -> dict[str, Any]:
    """transformers' generate with accelerate offloading: the layers that do not fit in
    `max_memory_bytes` of GPU 0 (accelerate's weight placement) stay in host memory and are copied in
    at every forward pass (how one runs a model larger than the GPU with transformers). sdpa, greedy,
    exactly `gen_len` new tokens.

    `total_memory_bytes` caps everything it allocates on the GPU (weights, the layer being copied in,
    KV cache, activations: the caching allocator's per-process fraction), as our stack's
    --device-memory caps ours. The KV cache lives on the GPU, so the batch is the largest that fits:
    the whole set first, halved on CUDA out-of-memory, the prompts then run in chunks of that size
    (timed from scratch) until `deadline` (a perf_counter time; at least one chunk runs). Without
    CUDA (--dry-run) the model loads on the CPU and no budget applies.
    """
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    kwargs: dict[str, Any] = {_dtype_kwarg(): dtype, "attn_implementation": "sdpa"}
    fraction = None
    if cuda:
        if total_memory_bytes:  # before the weights load: they count against it too
            fraction = min(1.0, total_memory_bytes / torch.cuda.get_device_properties(0).total_memory)
            torch.cuda.set_per_process_memory_fraction(fraction, 0)
        kwargs.update(device_map="auto", max_memory={0: max_memory_bytes, "cpu": "100GiB"})
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).eval()
    load_seconds = time.perf_counter() - t0
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    placement: dict[str, int] = {}  # parameter bytes accelerate placed on each device
    for name, where in getattr(model, "hf_device_map", {}).items():
        module = model.get_submodule(name) if name else model
        nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
        placement[str(where)] = placement.get(str(where), 0) + nbytes
    with torch.no_grad():  # warm-up: kernels, allocator, accelerate's hooks
        warm = torch.tensor([prompts[0][-4:]], device=device)
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False, pad_token_id=0)
    batch, ooms = len(prompts), 0
    while True:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            wall, generated, padded, ran = _generate_chunks(model, prompts, gen_len, batch, device, deadline)
            break
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
            ooms += 1
        # out of the except block, so the failed attempt's tensors are unreferenced before retrying
        batch = max(1, batch // 2)
    return {
        "generated_tokens_per_second": generated / wall,
        "seconds": wall,
        "generated_tokens": generated,
        "batch_size": batch,
        "chunks": -(-len(prompts) // batch),
        "chunks_run": -(-ran // batch),
        "prompts_run": ran,  # the first ones of the same prompts: a chunk's throughput is the baseline's
        "oom_retries": ooms,
        "padded_prompt_tokens": padded,
        "load_seconds": load_seconds,
        "max_memory_bytes": max_memory_bytes if cuda else None,  # accelerate's weight placement
        "total_memory_bytes": total_memory_bytes if fraction else None,  # everything on the GPU
        "memory_fraction": fraction,
        "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "placement_bytes": placement,  # on GPU 0 ("0") vs offloaded ("cpu")
        "dtype": str(dtype).removeprefix("torch."),
    }
