"""Measuring the roofs on this machine with our own kernels, instead of trusting datasheets.

The reference implementation took its constants as flags and predicted ~4.6x its measured
throughput. Here each roof is the rate our code actually reaches: GEMM FLOP/s, the bandwidth at
which expert FFNs stream their weights (small batches are weight-bound), the rate at which paged
decode attention reads its KV cache, host<->device copies (pinned, on CUDA), and the host's time to
issue a layer's kernels (hrm/host_issue.py). Quantized expert
pages are measured through the kernels chosen for them, their rates in bytes of the page format.
Results are cached per machine, device and page format; `moe-lightning profile` re-measures.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from moe_lightning import kv_format
from moe_lightning.hrm.hardware import HardwareProfile
from moe_lightning.hrm.host_issue import HostIssue, host_issue_seconds
from moe_lightning.hrm.layercost import NO_QUANT
from moe_lightning.hrm.pages import page_nbytes, page_scheme, random_experts
from moe_lightning.hrm.profile_cache import (  # noqa: F401 (PROFILE_CACHE_ENV, profile_cache_dir: the module's API)
    PROFILE_CACHE_ENV,
    cache_file,
    cache_warning,
    profile_cache_dir,
    read_cache,
    write_cache,
)
from moe_lightning.hrm.roofs import Measurements
from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.quant.kernels import dense_linear
from moe_lightning.quant.scheme import QuantScheme
from moe_lightning.spec import ModelSpec
from moe_lightning.stages.attention import Int8KV, paged_attention, plan_attention, quantize_int8
from moe_lightning.stages.moe import expert_ffn
from moe_lightning.weights import ExpertWeights

T = TypeVar("T")

# rows per expert GEMM at which the quantized kernels' compute rate is measured: compute-bound there
FLOPS_TOKENS = {"cpu": 64, "cuda": 1024}
# Part of every cache key: bump it when a kernel the roofs are measured with changes, so cached
# roofs from the old kernel are not trusted (2: weight-major small-batch GEMMs on CPU; 3: decode
# attention gathers whole blocks a chunk at a time, over an fp32, bf16 or fp16 KV cache; 4: the expert
# GEMM's own rate measured for unquantized pages too; 5: the native host GEMMs and the dense GEMM's race;
# 6: the native decode attention kernel's rewrite, ~2x its KV read rate: attention_bandwidth is its rate;
# 7: the host's issue time, hrm/host_issue.py: a profile cached before it would plan as if launches cost
# nothing, silently, so it is measured again rather than read back with the field's default 0)
KERNELS_VERSION = 7


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _best_seconds(lambda: a @ b, device, repeats)


def copy_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes moved per second by a large device-local copy (read + write)."""
    a = torch.empty(nbytes // 4, device=device)
    b = torch.empty_like(a)
    return 2 * nbytes / _best_seconds(lambda: b.copy_(a), device, repeats)


def expert_stream_bandwidth(
    device: torch.device,
    dtype: torch.dtype,
    hidden: int,
    inter: int,
    experts: int = 8,
    tokens: int = 8,
    repeats: int = 3,
    weights: Sequence[ExpertWeights] | None = None,
) -> float:
    """Page bytes per second of expert FFNs at a small, weight-bound batch (distinct experts, so
    nothing stays in cache between them), activations in `dtype`. `weights`: measure on these (a
    service's real experts, quantized or not: the rate is then in bytes of their page format, through
    the kernels chosen for them; the warm-up calls choose them)."""
    ws = list(weights) if weights is not None else random_experts(device, dtype, hidden, inter, experts)
    x = torch.randn(tokens, ws[0].w13.shape[1], device=device, dtype=dtype)

    def run() -> None:
        for w in ws:
            expert_ffn(w, x)

    return sum(page_nbytes(w) for w in ws) / _best_seconds(run, device, repeats)


def expert_gemm_flops(
    weights: Sequence[ExpertWeights], device: torch.device, dtype: torch.dtype, tokens: int, repeats: int = 3
) -> float:
    """FLOP/s of expert FFNs at `tokens` rows each (compute-bound), through the kernels their format uses."""
    inter, hidden = weights[0].w2.shape[1], weights[0].w2.shape[0]
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)

    def run() -> None:
        for w in weights:
            expert_ffn(w, x)

    return len(weights) * 2 * tokens * 3 * hidden * inter / _best_seconds(run, device, repeats)


def dense_stream_bandwidth(
    tensors: Sequence[torch.Tensor], device: torch.device, tokens: int = 8, repeats: int = 3
) -> float:
    """Bytes per second dense projections (a model's own weights) read at a small, weight-bound batch."""
    xs = {t.shape[1]: torch.randn(tokens, t.shape[1], device=device, dtype=t.dtype) for t in tensors}

    def run() -> None:
        for t in tensors:
            dense_linear(xs[t.shape[1]], t)

    return sum(t.numel() * t.element_size() for t in tensors) / _best_seconds(run, device, repeats)


def attention_bandwidth(
    spec: ModelSpec,
    batch: int = 16,
    context: int = 512,
    block_size: int = 16,
    repeats: int = 3,
    dtype: torch.dtype | str = torch.float32,
) -> float:
    """KV bytes per second that paged decode attention reads on the host from a cache of `dtype` (a float
    dtype or a kv_format name: "int8" reads int8 values and their scales, dequantizing as it goes), counted
    in that format's bytes per token, scales included: the cost model multiplies this rate by them."""
    # one layer of attention over the whole context is all this needs; the spec's dense (and sliding)
    # layers would index past it
    one_layer = replace(spec, num_layers=1, dense_layers=(), sliding_layers=None, sliding_window=None)
    blocks = batch * -(-context // block_size)
    cache = PagedKVCache(one_layer, blocks, block_size, dtype=dtype)
    seqs = list(range(batch))
    cache.append(seqs, [context - 1] * batch)
    meta = cache.append(seqs, [1] * batch)
    plan = plan_attention(meta)
    if isinstance(cache.k, Int8KV) and isinstance(cache.v, Int8KV):
        for part in (cache.k, cache.v):  # random K/V, quantized as write_kv stores them
            values, scales = quantize_int8(torch.randn(part.values.shape))
            part.values.copy_(values)
            part.scales.copy_(scales)
        q_dtype = torch.float32  # an int8 cache is attended in fp32, whatever q's dtype
    else:
        cache.k.normal_()
        cache.v.normal_()
        q_dtype = cache.k.dtype
    q = torch.randn(batch, spec.num_heads, spec.head_dim).to(q_dtype)
    sinks = torch.zeros(spec.num_heads) if spec.attention_sinks else None  # the path a model with sinks takes
    seconds = _best_seconds(
        lambda: paged_attention(q, cache.k[0], cache.v[0], plan, sinks), torch.device("cpu"), repeats
    )
    per_token = kv_format.bytes_per_token(cache.format, 1, spec.num_kv_heads, spec.head_dim, spec.kv_tensors)
    return batch * context * per_token / seconds


def link_bandwidth(device: torch.device, nbytes: int = 256 << 20) -> tuple[float, float]:
    """(host -> device, device -> host) bytes/s from pinned host memory."""
    host = torch.empty(nbytes // 4, pin_memory=True)
    dev = torch.empty(nbytes // 4, device=device)
    h2d = nbytes / _best_seconds(lambda: dev.copy_(host, non_blocking=True), device, 3)
    d2h = nbytes / _best_seconds(lambda: host.copy_(dev, non_blocking=True), device, 3)
    return h2d, d2h


def host_memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def cached_host_issue(
    dev: torch.device, dtype: torch.dtype, quant: QuantScheme, refresh: bool = False, cache_dir: Path | None = None
) -> HostIssue:
    """The host's issue time (hrm/host_issue.py) on this machine, device, dtype and page format: it is
    measured on a tiny layer whatever the model, so every model's calibration shares one measurement
    (~1 s each: a test suite's hundred model shapes paid it a hundred times)."""
    name = f"{platform.node() or 'host'}-host_issue-{dev.type}-{str(dtype).removeprefix('torch.')}"
    path = cache_file(cache_dir, f"{name}-{quant.key()}-k{KERNELS_VERSION}.json")
    return _cached(
        path, refresh, lambda d: HostIssue(**d), lambda: host_issue_seconds(dev, dtype, quant), HostIssue._asdict
    )


def measure(
    spec: ModelSpec,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    quant: QuantScheme = NO_QUANT,
    refresh: bool = False,
    cache_dir: Path | None = None,
) -> HardwareProfile:
    """Measures every roof for `spec`'s shapes on `device` (CPU-only: host and device are one); with
    `quant`, also the expert GEMM's roofs on pages of that format (random weights, quantized)."""
    dev = torch.device(device)
    dtype = dtype or (torch.float32 if dev.type == "cpu" else torch.bfloat16)
    host_flops = matmul_flops(torch.device("cpu"), torch.float32)
    expert_bw = expert_stream_bandwidth(dev, dtype, spec.hidden_size, spec.intermediate_size)
    pages = random_experts(dev, dtype, spec.hidden_size, spec.intermediate_size, 8 if quant.quantized else 2, quant)
    # the expert GEMM's own rate at the rows a planned micro-batch gives each expert: well below the
    # square GEMM's peak on a CPU (64 rows of the bench model reach ~0.6 of it), for any page format
    roofs: dict[str, Any] = {
        "expert_format": quant.key(),
        "expert_bandwidth": expert_stream_bandwidth(dev, dtype, 0, 0, weights=pages) if quant.quantized else expert_bw,
        "expert_flops": expert_gemm_flops(pages[:2], dev, dtype, FLOPS_TOKENS.get(dev.type, 64)),
    }
    attn_bw = attention_bandwidth(spec, dtype=dtype)  # the `auto` KV dtype: the weights'
    issue = cached_host_issue(dev, dtype, quant, refresh, cache_dir)  # the host's time to issue a layer
    roofs |= {
        "host_micro_batch_seconds": issue.micro_batch,
        "host_ffn_seconds": issue.ffn,
        "host_expert_seconds": issue.expert,
    }
    if dev.type == "cuda":
        gpu_flops = matmul_flops(dev, dtype, n=4096)
        h2d, d2h = link_bandwidth(dev)
        gpu_memory = float(torch.cuda.get_device_properties(dev).total_memory)
        shared = False
        roofs["compute_capability"] = float("{}.{}".format(*torch.cuda.get_device_capability(dev)))
    else:
        gpu_flops = host_flops
        h2d = d2h = copy_bandwidth(dev) / 2
        gpu_memory = host_memory_bytes()
        shared = True
    return HardwareProfile(
        name=f"calibrated-{platform.node() or 'host'}-{dev.type}",
        gpu_flops=gpu_flops,
        gpu_bandwidth=expert_bw,
        gpu_memory=gpu_memory,
        cpu_flops=host_flops,
        cpu_bandwidth=attn_bw,
        cpu_memory=host_memory_bytes(),
        h2d_bandwidth=h2d,
        d2h_bandwidth=d2h,
        shared_host_device=shared,
        source="calibrated",
        **roofs,
    )


def cached_profile(
    spec: ModelSpec,
    device: str = "cpu",
    refresh: bool = False,
    cache_dir: Path | None = None,
    quant: QuantScheme = NO_QUANT,
) -> HardwareProfile:
    """The machine's calibrated profile, measured once per (host, device, model shape, expert page
    format) and cached."""
    key = f"{platform.node() or 'host'}-{device.replace(':', '')}-{spec.hidden_size}x{spec.intermediate_size}"
    key += (f"-{quant.key()}" if quant.quantized else "") + f"-k{KERNELS_VERSION}"
    path = cache_file(cache_dir, f"{key}.json")
    if not refresh and path is not None and read_cache(path) is not None:
        try:
            return HardwareProfile.from_file(path)
        except ValueError as exc:  # an older or damaged cache: measure again
            cache_warning("profile_cache_damaged", path, exc)
    profile = measure(spec, device, quant=quant, refresh=refresh, cache_dir=cache_dir)
    write_cache(path, profile.to_json())
    return profile


def measure_expert_side(
    experts: Sequence[ExpertWeights],
    device: str,
    memory_bytes: float,
    dtype: torch.dtype | None = None,
    dense: Sequence[torch.Tensor] | None = None,
    scheme: QuantScheme | None = None,
    refresh: bool = False,
    cache_dir: Path | None = None,
) -> Measurements:
    """gpu_expert's warm-up: GEMM rate, the rate its real experts stream weights, the host link, the
    host's time to issue a layer's launches (`refresh`, `cache_dir`: its cache's, cached_host_issue).

    `dtype`: the model's (activations, the matmul peak); default: the experts' own when they are
    unquantized, else the dense weights'. `dense`: some of the model's dense weights (e.g. every
    layer's wqkv and wo), on whose read rate the dense stages are planned when the experts are
    quantized; without them random expert-shaped dense weights stand in. `scheme`: the pages' format as
    the weight store names it (the key the planner matches); default: read off the experts."""
    dev = torch.device(device)
    scheme = scheme or page_scheme(experts[0])
    if dtype is None:
        if not scheme.quantized:
            dtype = experts[0].w13.dtype
        elif dense:
            dtype = dense[0].dtype
        else:
            raise ValueError("quantized experts carry no model dtype: pass dtype (or the dense weights)")
    stream = expert_stream_bandwidth(dev, dtype, 0, 0, weights=experts)
    quantized: dict[str, Any] = {  # the expert GEMM's own roofs, in any format (see measure())
        "expert_format": scheme.key(),
        "expert_stream_bandwidth": stream,
        "expert_matmul_flops": expert_gemm_flops(experts[:2], dev, dtype, FLOPS_TOKENS.get(dev.type, 64)),
    }
    if scheme.quantized:
        hidden, inter = experts[0].w2.shape
        stream = (
            dense_stream_bandwidth(dense, dev)
            if dense
            else expert_stream_bandwidth(dev, dtype, hidden, inter, experts=min(2, len(experts)))
        )
    if dev.type == "cuda":
        h2d, d2h = link_bandwidth(dev)
        flops = matmul_flops(dev, dtype, n=4096)
    else:
        h2d = d2h = copy_bandwidth(dev) / 2
        flops = matmul_flops(dev, dtype)
    issue = cached_host_issue(dev, dtype, scheme, refresh, cache_dir)  # on tiny pages of the experts' format
    quantized |= {
        "host_micro_batch_seconds": issue.micro_batch,
        "host_ffn_seconds": issue.ffn,
        "host_expert_seconds": issue.expert,
    }
    return Measurements(
        matmul_flops=flops,
        weight_stream_bandwidth=stream,
        memory_bytes=memory_bytes,
        h2d_bandwidth=h2d,
        d2h_bandwidth=d2h,
        shared_host_device=dev.type == "cpu",
        source=f"gpu_expert@{platform.node()}",
        **quantized,
    )


def expert_side_key(device: torch.device | str, dtype: torch.dtype, spec: ModelSpec, scheme: QuantScheme) -> str:
    """gpu_expert's cache key for cached_measurements: one per device, model dtype, shape and page
    format (unquantized pages keep the key they always had, so earlier caches stay valid)."""
    key = f"gpu_expert-{device}-{dtype}-{spec.hidden_size}x{spec.intermediate_size}"
    return (key + (f"-{scheme.key()}" if scheme.quantized else "")).replace(":", "")


def measure_attention_side(
    spec: ModelSpec, contexts: Sequence[int] = (128, 512, 2048), kv_dtype: torch.dtype | str = torch.float32
) -> Measurements:
    """cpu_attention's warm-up: the KV read rate of paged decode attention at a few context lengths,
    over a cache of the format the service keeps its KV in (a float dtype, or "int8")."""
    rates = [attention_bandwidth(spec, context=c, dtype=kv_dtype) for c in contexts]
    return Measurements(
        matmul_flops=matmul_flops(torch.device("cpu"), torch.float32),
        attention_bandwidth=sum(rates) / len(rates),
        memory_bytes=host_memory_bytes(),
        source=f"cpu_attention@{platform.node()}",
    )


def cached_measurements(
    key: str, measure_fn: Callable[[], Measurements], refresh: bool = False, cache_dir: Path | None = None
) -> Measurements:
    """A service's warm-up measurements, re-used across restarts on this machine."""
    path = cache_file(cache_dir, f"{platform.node() or 'host'}-{key}-k{KERNELS_VERSION}.json")
    return _cached(path, refresh, lambda d: Measurements(**d), measure_fn, asdict)


def _cached(
    path: Path, refresh: bool, load: Callable[[dict], T], measure: Callable[[], T], dump: Callable[[T], dict]
) -> T:
    """What `path` holds (`load` of its JSON), else `measure`'s result, written there (`dump`)."""
    text = None if refresh else read_cache(path)
    if text is not None:
        try:
            return load(json.loads(text))
        except (ValueError, TypeError, RecursionError):
            pass  # an older or damaged cache: measure again
    value = measure()
    write_cache(path, json.dumps(dump(value)))
    return value
