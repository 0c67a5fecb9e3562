"""The per-layer decode cost model of the Hierarchical Roofline Model.

Each resource has a roofline: time = max(flops / peak, bytes / bandwidth); data that crosses the
host-device link pays bytes / link bandwidth. With CGOPipe overlapping the three resources, a layer
takes as long as its slowest resource plus the pipeline fill (one micro-batch's share of the other
compute resource); throughput is N / (L * that). When the "device" is the host
itself (a CPU-only run) nothing overlaps: the device and host times add and there is no link.

Symbols (docs/design.md): h1 hidden, h2 expert intermediate, E experts, k top-k, nh/nkv heads, d head dim,
s prompt length, n generation length, b bytes per weight, N batch, mu micro-batch, n_ub = N / mu.

Expert pages may be quantized (`quant`, a QuantScheme): a page then holds its weights at
`quant.bytes_per_weight` (scales and zeros included) while the dense weights stay in the model dtype.
That changes what the link carries, what the memories hold and what the expert GEMM reads; its speed
per kernel is in hrm/kernels.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moe_lightning.hrm.hardware import HardwareProfile
from moe_lightning.hrm.kernels import KernelRoof, expert_kernels
from moe_lightning.placement import Placement, Side
from moe_lightning.quant.scheme import QuantScheme
from moe_lightning.spec import ModelSpec

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
NO_QUANT = QuantScheme()  # expert pages in the model dtype


@dataclass(frozen=True, slots=True)
class Workload:
    prompt_len: float  # s: average prompt tokens
    gen_len: int  # n: tokens generated per request

    def __post_init__(self) -> None:
        if self.prompt_len <= 0 or self.gen_len <= 0:
            raise ValueError("prompt length and generation length must be positive")

    @property
    def avg_context(self) -> float:
        """Average attended context over the decode: s + n/2."""
        return self.prompt_len + self.gen_len / 2

    @property
    def max_context(self) -> float:
        return self.prompt_len + self.gen_len


@dataclass(frozen=True, slots=True)
class Policy:
    batch: int  # N sequences decoded per step
    micro_batch: int  # mu sequences per micro-batch
    attention: Side = Side.HOST  # where attention runs ("cpu" / "gpu" accepted)
    experts: Side = Side.DEVICE  # where non-resident expert FFNs run
    resident_experts: int = 0  # (layer, expert) pages kept on the device, of L * E (r_w = this / (L * E))
    kv_gpu_fraction: float = 0.0  # r_c: share of the KV cache on the device (attention on GPU)

    def __post_init__(self) -> None:
        if self.batch < 1 or self.micro_batch < 1 or self.batch % self.micro_batch:
            raise ValueError(f"batch ({self.batch}) must be a positive multiple of micro_batch ({self.micro_batch})")
        sides = tuple(Side)
        if self.attention not in sides or self.experts not in sides:
            raise ValueError(f"attention and experts must be one of {', '.join(sides)}")
        object.__setattr__(self, "attention", Side(self.attention))
        object.__setattr__(self, "experts", Side(self.experts))
        if not 0.0 <= self.kv_gpu_fraction <= 1.0 or self.resident_experts < 0:
            raise ValueError("kv_gpu_fraction in [0, 1], resident_experts >= 0")

    @property
    def num_micro_batches(self) -> int:
        return self.batch // self.micro_batch

    @property
    def placement(self) -> Placement:
        return Placement(self.attention, self.experts)


@dataclass(frozen=True, slots=True)
class Headroom:
    gpu: float = 0.86  # usable share of device memory (the reference's value)
    cpu: float = 0.80  # usable share of host memory


@dataclass(frozen=True, slots=True)
class Estimate:
    policy: Policy
    stage_seconds: dict[str, float]  # per layer: what each resource spends, by stage
    resource_seconds: dict[str, float]  # per layer: gpu, cpu, link (each resource's total)
    layer_seconds: float
    tokens_per_second: float
    gpu_bytes: float
    cpu_bytes: float
    gpu_capacity: float
    cpu_capacity: float
    binding: str  # the resource with the largest time
    stage_work: dict[str, tuple[float, float]] = field(default_factory=dict)  # (flops, bytes) per layer
    kv_host_bytes: float = 0.0  # the part of cpu_bytes that is the host KV cache (in its own dtype)
    quant: QuantScheme = NO_QUANT  # the expert pages' format
    page_bytes: float = 0.0  # one expert page (w13 + w2) in that format
    link_bytes: dict[str, float] = field(default_factory=dict)  # per layer, per link stage
    kernels: dict[str, str] = field(default_factory=dict)  # expert stage -> the kernel the model assumed

    @property
    def fits(self) -> bool:
        return self.gpu_bytes <= self.gpu_capacity and self.cpu_bytes <= self.cpu_capacity


def _roof(flops: float, nbytes: float, peak: float, bandwidth: float) -> float:
    return max(flops / peak, nbytes / bandwidth)


def distinct_experts(tokens: float, spec: ModelSpec) -> float:
    """Expected experts touched by `tokens` tokens routing uniformly to top-k of E."""
    e, k = spec.num_experts, spec.top_k
    return e * (1.0 - (1.0 - k / e) ** tokens)


def sparse_share(spec: ModelSpec) -> float:
    """The share of layers with experts; the rest (Qwen-MoE's dense layers) run one dense MLP. The
    model is per layer, so per-layer expert and MLP work is this share's average over all layers."""
    return spec.num_sparse_layers / spec.num_layers


def page_bytes_per_weight(spec: ModelSpec, b: int, quant: QuantScheme = NO_QUANT) -> float:
    """Average bytes per weight of an expert page: w13 (2I, D) has D inputs per row, w2 (D, I) has I."""
    h1, h2 = spec.hidden_size, spec.intermediate_size
    return (2 * quant.bytes_per_weight(h1, b) + quant.bytes_per_weight(h2, b)) / 3


def weight_bytes(spec: ModelSpec, b: int, quant: QuantScheme = NO_QUANT) -> dict[str, float]:
    h1, h2, e = spec.hidden_size, spec.intermediate_size, spec.num_experts
    pb = page_bytes_per_weight(spec, b, quant)
    attn = h1 * (spec.q_size + 2 * spec.kv_size) + spec.q_size * h1
    f = sparse_share(spec)
    # a shared expert (Qwen2-MoE) computes for every token: dense work, always on the device; so
    # does a dense layer's MLP
    ffn_dense = f * (e * h1 + 3 * h1 * spec.shared_expert_size) + (1 - f) * 3 * h1 * spec.dense_intermediate_size
    return {
        "expert": 3 * h1 * h2 * pb,  # one expert page
        "layer_experts": 3 * h1 * h2 * e * pb,  # W_l of a sparse layer
        "layer_dense": (attn + 2 * h1 + ffn_dense) * b,  # averaged over the layers
        "embed_head": spec.vocab_size * h1 * b * (1 if spec.tie_word_embeddings else 2) + h1 * b,
    }


def estimate(
    spec: ModelSpec,
    work: Workload,
    hw: HardwareProfile,
    policy: Policy,
    dtype: str | None = None,
    headroom: Headroom = Headroom(),
    kv_dtype: str | None = None,
    quant: QuantScheme = NO_QUANT,
    overlap: bool = True,
) -> Estimate:
    """`dtype`: the weights' (default the spec's), also the device KV cache's; `kv_dtype`: the host KV
    cache's (cpu_attention's --kv-dtype; default the weights'); `quant`: the expert pages' format.
    `overlap=False`: the overlap-off baseline schedule (gpu_expert --no-overlap: every stage waits for
    the one before, a layer's experts copied when it starts), where the resources' times add up."""
    b = DTYPE_BYTES[dtype or spec.dtype]
    kv_b = DTYPE_BYTES[kv_dtype] if kv_dtype else b
    w = weight_bytes(spec, b, quant)
    page_bpw = page_bytes_per_weight(spec, b, quant)
    n, mu = policy.batch, policy.micro_batch
    n_ub = policy.num_micro_batches
    h1, h2, k = spec.hidden_size, spec.intermediate_size, spec.top_k
    layers = spec.num_layers
    ctx = work.avg_context
    kv_host_token = 2 * spec.kv_size * kv_b  # K and V of one token in one layer, host cache
    kv_device_token = 2 * spec.kv_size * b  # ... device cache (in the weights' dtype)
    f = sparse_share(spec)
    total_experts = spec.total_experts
    resident = min(policy.resident_experts, total_experts)
    streamed = (total_experts - resident) / layers  # per layer, on average
    # experts on the CPU: the non-resident ones compute on the host where they live, resident ones
    # still on the device; on the GPU every expert computes there and the non-resident ones stream
    host_share = (total_experts - resident) / total_experts if policy.experts == "cpu" else 0.0
    buffered = math.ceil((total_experts - resident) / spec.num_sparse_layers)  # the most a layer streams

    # --- device: dense projections, router, (experts), (attention), head amortised per layer -----
    dense_flops = 2 * n * (h1 * (spec.q_size + 2 * spec.kv_size) + spec.q_size * h1)
    dense_flops += 2 * n * (f * (h1 * spec.num_experts + 3 * h1 * spec.shared_expert_size))
    dense_flops += 2 * n * (1 - f) * 3 * h1 * spec.dense_intermediate_size
    dense_bytes = n_ub * w["layer_dense"]  # every micro-batch re-reads the dense weights
    stages: dict[str, float] = {}
    stage_work: dict[str, tuple[float, float]] = {}  # (flops, bytes) per compute stage, for the roofline plot

    def roof(stage: str, flops: float, nbytes: float, on_gpu: bool, share: float = 1.0) -> None:
        peak, bandwidth = (hw.gpu_flops, hw.gpu_bandwidth) if on_gpu else (hw.cpu_flops, hw.cpu_bandwidth)
        stage_work[stage] = (flops * share, nbytes * share)
        stages[stage] = _roof(flops, nbytes, peak, bandwidth) * share

    kernels: dict[str, KernelRoof] = {}

    def expert_roof(stage: str, flops: float, weights: float, on_gpu: bool, share: float) -> None:
        """The expert GEMM by the fastest kernel its side has for the page format; its work is
        recorded as the dense roofs see it (flops over the kernel's share of the peak, bytes moved)."""
        peak, bandwidth = (hw.gpu_flops, hw.gpu_bandwidth) if on_gpu else (hw.cpu_flops, hw.cpu_bandwidth)
        candidates = expert_kernels(hw, quant, b, page_bpw, on_gpu)
        kernel = min(candidates, key=lambda c: c.seconds(flops, weights, peak, bandwidth))
        kernels[stage] = kernel
        roof(stage, flops / kernel.flops, weights * kernel.traffic, on_gpu, share)

    roof("gpu_dense", dense_flops, dense_bytes, True)
    expert_flops = 2 * n * k * 3 * h1 * h2 * f
    expert_weights = 3 * h1 * h2 * f  # weights of one expert, averaged over the layers
    if host_share < 1.0:
        expert_roof(
            "gpu_experts", expert_flops, n_ub * distinct_experts(mu, spec) * expert_weights, True, 1 - host_share
        )
    if host_share > 0.0:
        touched = distinct_experts(n, spec) * expert_weights  # the host reads each needed expert once a step
        # one machine: the expert GEMM's calibrated roofs are the device-side ones wherever it is placed
        expert_roof("cpu_experts", expert_flops, touched, hw.shared_host_device, host_share)
    if hw.shared_host_device and policy.experts == "gpu" and streamed:
        # one memory: "streaming" is a memcpy that reads and writes every streamed expert each step
        stages["gpu_expert_copy"] = 2 * streamed * w["expert"] / hw.gpu_bandwidth
    attn_flops = 4 * n * ctx * spec.q_size
    if policy.attention == "cpu":
        roof("cpu_attention", attn_flops, n * ctx * kv_host_token, False)
    else:
        roof("gpu_attention", attn_flops, n * ctx * kv_device_token, True)
    head_flops = 2 * n * h1 * spec.vocab_size
    roof("gpu_head", head_flops, spec.vocab_size * h1 * b, True, share=1 / layers)

    # --- link: streamed experts, activations to/from CPU stages, KV when attention is on GPU ------
    link = 0.0
    link_bytes: dict[str, float] = {}

    def over_link(stage: str, nbytes: float, bandwidth: float) -> None:
        link_bytes[stage] = nbytes
        stages[stage] = nbytes / bandwidth

    if hw.shared_host_device and hw.simulated_link and policy.experts == "gpu" and streamed:
        # a CPU device behind a simulated link: only the expert pages are held to the link's rate (the
        # hand-offs stay in shared memory); the memcpy above still takes the shared cores' time
        over_link("link_weights", streamed * w["expert"], hw.h2d_bandwidth)
        link = stages["link_weights"]
    if not hw.shared_host_device:
        if policy.experts == "gpu":
            over_link("link_weights", streamed * w["expert"], hw.h2d_bandwidth)
        elif host_share > 0.0:
            over_link("link_experts_io", 2 * n * h1 * b, hw.h2d_bandwidth)
        if policy.attention == "cpu":
            over_link("link_qkv", n * (spec.q_size + 2 * spec.kv_size) * b, hw.d2h_bandwidth)
            over_link("link_attn_out", n * spec.q_size * b, hw.h2d_bandwidth)
        else:
            over_link("link_kv", (1 - policy.kv_gpu_fraction) * n * ctx * kv_host_token, hw.h2d_bandwidth)
        link = sum(v for s, v in stages.items() if s.startswith("link_"))

    gpu = sum(v for s, v in stages.items() if s.startswith("gpu_"))
    cpu = sum(v for s, v in stages.items() if s.startswith("cpu_"))
    resources = {"gpu": gpu, "cpu": cpu, "link": link}
    # Shared host/device: one set of cores and one memory, so compute never overlaps compute; a
    # simulated link still runs beside it. Otherwise CGOPipe hides the smaller of CPU and GPU work
    # behind the other only across micro-batches: one micro-batch's share of it stays exposed
    # (pipeline fill), all of it when n_ub = 1. With overlap off nothing hides anything.
    fill = (gpu + cpu - max(gpu, cpu)) / n_ub
    if not overlap:
        layer = gpu + cpu + link
    elif hw.shared_host_device:
        layer = max(gpu + cpu, link)
    else:
        layer = max(gpu, cpu, link) + fill
    binding = max(resources, key=lambda r: resources[r])

    # --- memory -----------------------------------------------------------------------------
    all_experts = spec.num_sparse_layers * w["layer_experts"]
    dense_all = layers * w["layer_dense"] + w["embed_head"]
    kv_host = n * work.max_context * kv_host_token * layers  # all of it, were it all on the host
    kv_device = n * work.max_context * kv_device_token * layers
    activations = mu * (4 * h1 + spec.q_size + 2 * spec.kv_size + 2 * h2 * k) * 4 + mu * spec.vocab_size * 4
    # a kernel's per-call copies of the largest expert linear (w13, 2I x D): dequantized or repacked
    # (one call at a time: the largest kernel's, on the side it runs)
    scratch = {s: kernel.scratch_bytes(2 * h2 * h1) for s, kernel in kernels.items()}
    activations += max((v for s, v in scratch.items() if s == "gpu_experts" or hw.shared_host_device), default=0.0)
    gpu_bytes = dense_all + activations
    gpu_bytes += resident * w["expert"]
    if policy.experts == "gpu" and buffered and not hw.shared_host_device:
        gpu_bytes += 2 * buffered * w["expert"]  # double buffer for one layer's streamed experts
    if policy.attention == "gpu":
        gpu_bytes += policy.kv_gpu_fraction * kv_device + mu * work.max_context * kv_device_token
    kv_host_bytes = (1 - policy.kv_gpu_fraction) * kv_host
    cpu_bytes = all_experts + dense_all + kv_host_bytes
    cpu_bytes += n * (spec.q_size * 2 + 2 * spec.kv_size) * b * 2  # staging for hand-offs
    if hw.shared_host_device:  # one memory: count it once, against the host
        cpu_bytes += activations + (policy.kv_gpu_fraction * kv_device if policy.attention == "gpu" else 0)
        gpu_bytes = cpu_bytes
    else:
        cpu_bytes += scratch.get("cpu_experts", 0.0)
    return Estimate(
        policy=policy,
        stage_seconds=stages,
        resource_seconds=resources,
        layer_seconds=layer,
        tokens_per_second=n / (layer * layers) if layer > 0 else float("inf"),
        gpu_bytes=gpu_bytes,
        cpu_bytes=cpu_bytes,
        gpu_capacity=headroom.gpu * (hw.cpu_memory if hw.shared_host_device else hw.gpu_memory),
        cpu_capacity=headroom.cpu * hw.cpu_memory,
        binding=binding,
        stage_work=stage_work,
        kv_host_bytes=kv_host_bytes,
        quant=quant,
        page_bytes=w["expert"],
        link_bytes=link_bytes,
        kernels={s: kernel.name for s, kernel in kernels.items()},
    )
