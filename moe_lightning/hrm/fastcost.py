"""The cost model's verdict on many policies of one search, without building an Estimate per policy.

The optimizer evaluates tens of thousands of policies that share the model, workload, hardware, dtypes
and page format; costmodel.estimate() re-derives everything from those on every call and builds five
dicts and two dataclasses the search never reads. PolicyCost derives the shared part once and returns
only what the search compares: throughput, the device and host times (the residency V-shape) and both
memories.

It must agree with estimate() to the last bit, not approximately: the search breaks ties in
throughput with a relative tolerance, and a value one ulp off can tip a comparison and change the
chosen policy. So every expression below performs estimate()'s floating-point operations in
estimate()'s order and groups only exact (integer) products differently; tests/test_hrm_search.py
checks the two bit for bit over a spread of policies. Change both together.

`ceiling` bounds a grid point's throughput over every resident count from the same numbers, so the
search can skip points that cannot win; unlike the costs it is a bound, with a margin for rounding.
"""

from __future__ import annotations

import math

from moe_lightning.hrm.costmodel import (
    DTYPE_BYTES,
    NO_QUANT,
    Headroom,
    Workload,
    page_bytes_per_weight,
    sparse_share,
    weight_bytes,
)
from moe_lightning.hrm.hardware import HardwareProfile
from moe_lightning.hrm.kernels import KernelRoof, expert_kernels
from moe_lightning.quant.scheme import QuantScheme
from moe_lightning.spec import ModelSpec

# (tokens/s, device seconds, host seconds, device bytes, host bytes) of one policy
Cost = tuple[float, float, float, float, float]


def _choose(kernels: tuple[KernelRoof, ...], flops: float, weights: float, peak: float, bandwidth: float) -> KernelRoof:
    """estimate()'s min() over KernelRoof.seconds: the first of the fastest."""
    if len(kernels) == 1:
        return kernels[0]
    return min(kernels, key=lambda c: c.seconds(flops, weights, peak, bandwidth))


class PolicyCost:
    """estimate(spec, work, hw, policy, dtype, headroom, kv_dtype, quant) for varying policies."""

    def __init__(
        self,
        spec: ModelSpec,
        work: Workload,
        hw: HardwareProfile,
        dtype: str | None = None,
        headroom: Headroom = Headroom(),  # noqa: B008 (frozen)
        kv_dtype: str | None = None,
        quant: QuantScheme = NO_QUANT,
    ) -> None:
        b = DTYPE_BYTES[dtype or spec.dtype]
        kv_b = DTYPE_BYTES[kv_dtype] if kv_dtype else b
        w = weight_bytes(spec, b, quant)
        page_bpw = page_bytes_per_weight(spec, b, quant)
        h1, h2, k, q, kv = spec.hidden_size, spec.intermediate_size, spec.top_k, spec.q_size, spec.kv_size
        f = sparse_share(spec)
        self.shared = hw.shared_host_device
        self.simulated_link = hw.shared_host_device and hw.simulated_link
        self.layers = spec.num_layers
        self.total_experts = spec.total_experts
        self.sparse_layers = spec.num_sparse_layers
        self.experts, self.miss = spec.num_experts, 1.0 - spec.top_k / spec.num_experts
        self.h1, self.h2, self.b, self.q = h1, h2, b, q
        self.ctx, self.max_ctx = work.avg_context, work.max_context
        self.kv_host_token, self.kv_device_token = 2 * kv * kv_b, 2 * kv * b
        self.f, self.dense_share, self.dense_mlp = f, 1 - f, spec.dense_intermediate_size
        self.attn_proj = h1 * (q + 2 * kv) + q * h1  # integers: any grouping is exact
        self.router_shared = f * (h1 * spec.num_experts + 3 * h1 * spec.shared_expert_size)
        self.expert_flops_per_token = k * 3 * h1 * h2
        self.expert_weights = 3 * h1 * h2 * f
        self.layer_dense, self.expert_page = w["layer_dense"], w["expert"]
        self.head_flops_per_token = 2 * h1 * spec.vocab_size
        self.head_bytes = spec.vocab_size * h1 * b
        self.inv_layers = 1 / self.layers
        self.qkv_width, self.act_width = q + 2 * kv, 4 * h1 + q + 2 * kv + 2 * h2 * k
        self.vocab = spec.vocab_size
        self.staging = (q * 2 + 2 * kv) * b * 2
        self.dense_all = self.layers * w["layer_dense"] + w["embed_head"]
        self.host_weights = self.sparse_layers * w["layer_experts"] + self.dense_all
        self.gpu_roofs = (hw.gpu_flops, hw.gpu_bandwidth)
        self.cpu_roofs = (hw.cpu_flops, hw.cpu_bandwidth)
        self.h2d, self.d2h = hw.h2d_bandwidth, hw.d2h_bandwidth
        self.gpu_kernels = expert_kernels(hw, quant, b, page_bpw, True)
        self.host_kernels = expert_kernels(hw, quant, b, page_bpw, hw.shared_host_device)
        self.host_expert_roofs = self.gpu_roofs if self.shared else self.cpu_roofs
        self.scratch_weights = 2 * h2 * h1
        self.gpu_capacity = headroom.gpu * (hw.cpu_memory if self.shared else hw.gpu_memory)
        self.cpu_capacity = headroom.cpu * hw.cpu_memory
        self._key: tuple[int, int, bool, bool] | None = None
        self._roofs: tuple[float, ...] = ()

    def distinct(self, tokens: int) -> float:
        """costmodel.distinct_experts"""
        return self.experts * (1.0 - self.miss**tokens)

    def roofs(self, n: int, mu: int, att_gpu: bool, exp_gpu: bool) -> tuple[float, ...]:
        """The stage times that do not depend on the resident count or the KV share, expert stages
        before their share: (dense, device experts, host experts, attention, head, device scratch,
        host scratch); the host's expert stage is 0 with the experts on the device (estimate() has
        none then). The search asks for one point's several counts and shares in a row: kept."""
        key = (n, mu, att_gpu, exp_gpu)
        if key == self._key:
            return self._roofs
        gpu_peak, gpu_bw = self.gpu_roofs
        n_ub = n // mu
        dense_flops = 2 * n * self.attn_proj
        dense_flops += 2 * n * self.router_shared
        dense_flops += 2 * n * self.dense_share * 3 * self.h1 * self.dense_mlp
        dense = max(dense_flops / gpu_peak, n_ub * self.layer_dense / gpu_bw)
        flops = 2 * n * self.expert_flops_per_token * self.f
        weights = n_ub * self.distinct(mu) * self.expert_weights
        kernel = _choose(self.gpu_kernels, flops, weights, gpu_peak, gpu_bw)
        gpu_experts = max(flops / kernel.flops / gpu_peak, weights * kernel.traffic / gpu_bw)
        gpu_scratch = kernel.scratch_bytes(self.scratch_weights)
        host_experts = host_scratch = 0.0
        if not exp_gpu:
            touched = self.distinct(n) * self.expert_weights
            peak, bw = self.host_expert_roofs
            kernel = _choose(self.host_kernels, flops, touched, peak, bw)
            host_experts = max(flops / kernel.flops / peak, touched * kernel.traffic / bw)
            host_scratch = kernel.scratch_bytes(self.scratch_weights)
        attn_flops = 4 * n * self.ctx * self.q
        if att_gpu:
            attention = max(attn_flops / gpu_peak, n * self.ctx * self.kv_device_token / gpu_bw)
        else:
            peak, bw = self.cpu_roofs
            attention = max(attn_flops / peak, n * self.ctx * self.kv_host_token / bw)
        head = max(n * self.head_flops_per_token / gpu_peak, self.head_bytes / gpu_bw) * self.inv_layers
        self._key = key
        self._roofs = (dense, gpu_experts, host_experts, attention, head, gpu_scratch, host_scratch)
        return self._roofs

    def ceiling(self, n: int, mu: int, att_gpu: bool, exp_gpu: bool, r_c: float) -> float:
        """An upper bound on the tokens/s of this point at any resident count that fits (0: none fits).

        The device holds at most j_max resident experts: its memory without them (and without the
        double buffer) plus j_max pages. With h the host's share of the experts (0 with them on the
        device, at least 1 - j_max / (L E) on the host), the device time is g0 + rg (1 - h), the host
        time c0 + rc h, and the link carries at least the attention traffic plus the streamed pages
        (or the host experts' activations), so the layer takes at least
        max(link, max(g, c) + min(g, c) / n_ub) (g + c on one machine: the same with n_ub = 1, and
        no memory limit on j). That is convex in h: least at an end of the range or where g = c.
        It is evaluated in floats from the stage times estimate() uses, a few roundings away from
        the real values on either side; a relative slack of 1e-12, far above those, keeps the bound
        above estimate()'s throughput and j_max at or above the largest count that fits."""
        slack = 1e-12
        dense, rg, rc, attention, head, gpu_scratch, _ = self.roofs(n, mu, att_gpu, exp_gpu)
        total, n_ub = self.total_experts, n // mu
        g0 = dense + (attention if att_gpu else 0.0) + head
        c0 = 0.0 if att_gpu else attention
        lo = 0.0  # the least host share
        link = 0.0
        if self.shared:
            n_ub = 1
        else:
            kv_host = (1 - r_c) * n * self.max_ctx * self.kv_host_token * self.layers
            if self.host_weights + kv_host + n * self.staging > self.cpu_capacity * (1 + slack):
                return 0.0
            held = self.dense_all + mu * self.act_width * 4 + mu * self.vocab * 4 + (gpu_scratch if exp_gpu else 0.0)
            if att_gpu:
                held += r_c * n * self.max_ctx * self.kv_device_token * self.layers
                held += mu * self.max_ctx * self.kv_device_token
            room = self.gpu_capacity - held + slack * (self.gpu_capacity + held)
            if room < 0:
                return 0.0
            left = total - min(total, math.floor(room / self.expert_page))
            if att_gpu:
                link = (1 - r_c) * n * self.ctx * self.kv_host_token / self.h2d
            else:
                link = n * self.qkv_width * self.b / self.d2h + n * self.q * self.b / self.h2d
            if exp_gpu:
                link += left / self.layers * self.expert_page / self.h2d
            elif left:
                lo = left / total
                link += 2 * n * self.h1 * self.b / self.h2d
        shares = [0.0] if exp_gpu else [lo, 1.0]
        if not exp_gpu and rg + rc > 0 and lo < (g0 + rg - c0) / (rg + rc) < 1.0:
            shares.append((g0 + rg - c0) / (rg + rc))
        layer = math.inf
        for h in shares:
            g, c = g0 + rg * (1 - h), c0 + rc * h
            layer = min(layer, max(link, max(g, c) + min(g, c) / n_ub))
        return n / (layer * self.layers) * (1 + slack) if layer > 0 else math.inf

    def __call__(self, n: int, mu: int, att_gpu: bool, exp_gpu: bool, resident: int, r_c: float) -> Cost:
        """The policy (n, mu, attention on the device?, experts on the device?, resident, r_c)."""
        dense, gpu_experts, host_experts, attention, head, gpu_scr, host_scr = self.roofs(n, mu, att_gpu, exp_gpu)
        total, shared = self.total_experts, self.shared
        resident = min(resident, total)
        streamed = (total - resident) / self.layers
        host_share = 0.0 if exp_gpu else (total - resident) / total
        gpu = dense
        cpu = 0.0
        if host_share < 1.0:
            gpu += gpu_experts * (1 - host_share)
        if host_share > 0.0:
            cpu += host_experts * host_share
        if shared and exp_gpu and streamed:
            gpu += 2 * streamed * self.expert_page / self.gpu_roofs[1]
        if att_gpu:
            gpu += attention
        else:
            cpu += attention
        gpu += head
        if shared:
            link = streamed * self.expert_page / self.h2d if self.simulated_link and exp_gpu and streamed else 0.0
            layer = max(gpu + cpu, link)
        else:
            link = 0.0
            if exp_gpu:
                link += streamed * self.expert_page / self.h2d
            elif host_share > 0.0:
                link += 2 * n * self.h1 * self.b / self.h2d
            if att_gpu:
                link += (1 - r_c) * n * self.ctx * self.kv_host_token / self.h2d
            else:  # two stages: added one at a time, as estimate() sums them
                link += n * self.qkv_width * self.b / self.d2h
                link += n * self.q * self.b / self.h2d
            layer = max(gpu, cpu, link) + (gpu + cpu - max(gpu, cpu)) / (n // mu)
        tokens = n / (layer * self.layers) if layer > 0 else math.inf

        activations = mu * self.act_width * 4 + mu * self.vocab * 4
        if shared:
            scratch = [s for s, on in ((gpu_scr, host_share < 1.0), (host_scr, host_share > 0.0)) if on]
            activations += max(scratch, default=0.0)
        else:
            activations += gpu_scr if host_share < 1.0 else 0.0
        kv_device = n * self.max_ctx * self.kv_device_token * self.layers
        gpu_bytes = self.dense_all + activations
        gpu_bytes += resident * self.expert_page
        buffered = math.ceil((total - resident) / self.sparse_layers)
        if exp_gpu and buffered and not shared:
            gpu_bytes += 2 * buffered * self.expert_page
        if att_gpu:
            gpu_bytes += r_c * kv_device + mu * self.max_ctx * self.kv_device_token
        cpu_bytes = self.host_weights + (1 - r_c) * (n * self.max_ctx * self.kv_host_token * self.layers)
        cpu_bytes += n * self.staging
        if shared:
            cpu_bytes += activations + (r_c * kv_device if att_gpu else 0)
            gpu_bytes = cpu_bytes
        elif host_share > 0.0:
            cpu_bytes += host_scr
        return tokens, gpu, cpu, gpu_bytes, cpu_bytes
