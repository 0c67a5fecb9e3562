"""Baseline: transformers' generate with accelerate offloading the layers that do not fit the GPU."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_lightning.benchmark import left_pad


def _dtype_kwarg() -> str:
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # `dtype` replaced `torch_dtype` in 4.56


class _StepClock:
    """A logits processor that only notes when each forward pass's logits are ready: generate calls it
    once per new token, after that token's forward (the prefill's for the first), so the time from the
    first call to the last is the decode passes' (the device synchronised at each call, which costs
    little against an offloaded forward pass of hundreds of ms)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return scores


@dataclass
class _Chunks:
    """What the chunks that ran measured."""

    seconds: float = 0.0
    generated: int = 0
    padded: int = 0
    ran: int = 0
    decode_seconds: float = 0.0  # from each chunk's first logits to its last
    decode_tokens: int = 0  # tokens of those passes: (gen_len - 1) per prompt


def _generate_chunks(
    model: Any, prompts: list[list[int]], gen_len: int, batch: int, device: torch.device, deadline: float
) -> _Chunks:
    """Greedy generate over `prompts` in chunks of `batch`, left padded per chunk, until the prompts
    run out or the next chunk would end past `deadline` (perf_counter; one chunk always runs: its
    throughput is the baseline's, the chunks after it only repeat it)."""
    from transformers import LogitsProcessorList

    out_of = _Chunks()
    last = 0.0
    for start in range(0, len(prompts), batch):
        if out_of.ran and time.perf_counter() + last > deadline:
            break
        chunk = prompts[start : start + batch]
        ids, mask = left_pad(chunk, device)
        width = ids.shape[1]
        clock = _StepClock(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=gen_len,
                min_new_tokens=gen_len,
                do_sample=False,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([clock]),
            )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        last = time.perf_counter() - t0
        out_of.seconds += last
        out_of.generated += (out.shape[1] - width) * len(chunk)
        out_of.padded += width * len(chunk)
        out_of.ran += len(chunk)
        if len(clock.times) > 1:
            out_of.decode_seconds += clock.times[-1] - clock.times[0]
            out_of.decode_tokens += (len(clock.times) - 1) * len(chunk)
        del out
    return out_of


def _restore_offloaded(model: Any) -> int:
    """After an out-of-memory error inside a forward pass: the offloaded module whose weights accelerate
    had copied in for it never ran its post-forward hook, so its layer (2.9 GB for Mixtral) would stay on
    the GPU and fail every smaller retry. Sends such weights back (to `meta`, as the hook does); returns
    how many modules it touched."""
    from accelerate.hooks import AlignDevicesHook, SequentialHook

    touched = 0
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        hooks = hook.hooks if isinstance(hook, SequentialHook) else (hook,)
        for h in hooks:
            if isinstance(h, AlignDevicesHook) and h.offload:
                on_device = [t for t in module.parameters(recurse=h.place_submodules) if t.device.type != "meta"]
                if on_device:
                    h._offload_weights(module)  # accelerate's own: what post_forward would have done
                    touched += 1
    return touched


def transformers_offload_generate(
    model_dir: Path,
    prompts: list[list[int]],
    gen_len: int,
    max_memory_bytes: int,
    dtype: torch.dtype = torch.bfloat16,
    total_memory_bytes: int | None = None,
    deadline: float = float("inf"),
    start_batch: int | None = None,
) -> dict[str, Any]:
    """transformers' generate with accelerate offloading: the layers that do not fit in
    `max_memory_bytes` of GPU 0 (accelerate's weight placement) stay in host memory and are copied in
    at every forward pass (how one runs a model larger than the GPU with transformers). sdpa, greedy,
    exactly `gen_len` new tokens.

    `total_memory_bytes` caps everything it allocates on the GPU (weights, the layer being copied in,
    KV cache, activations: the caching allocator's per-process fraction), as our stack's
    --device-memory caps ours. The KV cache lives on the GPU, so the batch is the largest that fits:
    `start_batch` first (the HRM's estimate of what fits: bench/gpucheck/predict.py; default the whole
    set), halved on CUDA out-of-memory, the layer stranded by the failed pass sent back each time, the
    prompts then run in chunks of that size (timed from scratch) until `deadline` (a perf_counter time;
    at least one chunk runs). Without CUDA (--dry-run) the model loads on the CPU and no budget applies.
    Decode is timed apart (a logits processor's clock): tokens after the first over their passes' time.
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
    batch, ooms, restored = max(1, min(len(prompts), start_batch or len(prompts))), 0, 0
    while True:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            run = _generate_chunks(model, prompts, gen_len, batch, device, deadline)
            break
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
            ooms += 1
        # out of the except block, so the failed attempt's tensors are unreferenced before retrying
        restored += _restore_offloaded(model)
        batch = max(1, batch // 2)
    return {
        "generated_tokens_per_second": run.generated / run.seconds,
        "decode_tokens_per_second": run.decode_tokens / run.decode_seconds if run.decode_seconds else None,
        "seconds": run.seconds,
        "decode_seconds": run.decode_seconds,
        "generated_tokens": run.generated,
        "batch_size": batch,
        "start_batch": start_batch,
        "chunks": -(-len(prompts) // batch),
        "chunks_run": -(-run.ran // batch),
        "prompts_run": run.ran,  # the first ones of the same prompts: a chunk's throughput is the baseline's
        "oom_retries": ooms,
        "layers_restored_after_oom": restored,
        "padded_prompt_tokens": run.padded,
        "load_seconds": load_seconds,
        "max_memory_bytes": max_memory_bytes if cuda else None,  # accelerate's weight placement
        "total_memory_bytes": total_memory_bytes if fraction else None,  # everything on the GPU
        "memory_fraction": fraction,
        "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "placement_bytes": placement,  # on GPU 0 ("0") vs offloaded ("cpu")
        "dtype": str(dtype).removeprefix("torch."),
    }
