"""The per-layer decode cost of the Hierarchical Roofline Model: the one formula.

Each resource has a roofline: time = max(flops / peak, bytes / bandwidth); data that crosses the
host-device link pays bytes / link bandwidth. With CGOPipe overlapping the three resources, a layer
takes as long as its slowest resource plus the pipeline fill (one group's share of the other compute
resource); throughput is N / (L * that). When the "device" is the host itself (a CPU-only run)
nothing overlaps: the device and host times add and there is no link.

Symbols (docs/design.md): h1 hidden, h2 expert intermediate, E experts, k top-k, nh/nkv heads, d head
dim, s prompt length, n generation length, b bytes per weight, N batch, mu micro-batch, n_ub = N / mu,
g groups of micro-batches whose expert FFN runs at once (`groups`: 0, or n_ub and more, is one FFN a
micro-batch, CGOPipe's own order; services/gpu_expert/schedule.py group_bounds).

Grouped experts: the device reads each expert a group touches once a group, g E(1 - (1 - k/E)^(N/g))
experts a layer instead of n_ub E(1 - (1 - k/E)^mu), and the group's FFN holds the activations of its
ceil(n_ub / g) micro-batches. The price is overlap: attention of one group hides behind the experts
of another, so the fill is one group's share, (gpu + cpu - max(gpu, cpu)) / g. The overlap-off
baseline does not group (g = n_ub).

Expert pages may be quantized (`quant`, a QuantScheme): a page then holds its weights at
`quant.bytes_per_weight` (scales and zeros included) while the dense weights stay in the model dtype.
That changes what the link carries, what the memories hold and what the expert GEMM reads; its speed
per kernel is in hrm/kernels.py.

CostModel.layer() takes the policy as Python scalars or as numpy arrays that broadcast: estimate()
asks it for one policy, the search (hrm/optimizer.py) for a whole grid at once, so the two cannot
disagree. Scalars run on Python's operators (numpy's per-call cost would be most of estimate()'s time),
arrays on numpy's, through the same expressions. Only operations whose result IEEE 754 fixes appear
(+ - * / correctly rounded; max, min, ceil, selection exact), so a grid's element is the scalar
policy's value to the bit (the search breaks ties with a tolerance: an ulp could tip one). The one
power, (1 - k/E)^mu, is Python's in both, as numpy's SIMD pow may round differently from libm's
(the KV headroom's square root is correctly rounded in both).

The host issues every kernel (hrm/host_issue.py): a GPU's time is max(compute, issue), a CPU
device's their sum (CostModel._times, _issue).

The workload, the memory headroom and the KV rule (how the KV of N sequences counts against host
memory) are hrm/workload.py's, re-exported here.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from moe_lightning.hrm.hardware import HardwareProfile
from moe_lightning.hrm.kernels import KernelRoof, expert_kernels
from moe_lightning.hrm.sizes import DTYPE_BYTES as DTYPE_BYTES
from moe_lightning.hrm.sizes import NO_QUANT as NO_QUANT
from moe_lightning.hrm.sizes import (
    distinct_experts,
    dtype_bytes,
    kv_token_bytes,
    page_bytes_per_weight,
    sparse_share,
    weight_bytes,
)
from moe_lightning.hrm.workload import (  # noqa: F401 (re-exported: the KV rule and the workload are the formula's inputs)
    ARRAYS,
    EXPECTED_USE,
    KV_RULE_FOR_ADMISSION,
    KV_RULES,
    MAX_CONTEXT,
    MTBENCH_PROMPT_LEN,
    MTBENCH_PROMPT_STD,
    SCALARS,
    Headroom,
    Values,
    Workload,
    _Ops,
    check_kv_rule,
    kv_sequences,
    kv_tokens,
    largest_fitting,
)
from moe_lightning.quant.scheme import QuantScheme
from moe_lightning.spec import ModelSpec


class Stage(NamedTuple):
    seconds: Values  # per layer
    present: Values  # whether the policy has this stage (estimate() lists only those)
    work: tuple[Values, Values] | None = None  # (flops, bytes) of a compute stage, for the roofline plot
    link_bytes: Values | None = None  # what a link stage carries


class LayerCost(NamedTuple):
    """One policy's (or, element by element, a grid's) verdict."""

    stages: dict[str, Stage]  # in the order the resources sum them
    kernels: dict[str, Values]  # expert stage -> index into CostModel.kernels[stage]
    gpu: Values  # each resource's total per layer
    cpu: Values
    link: Values
    layer: Values  # seconds per layer
    tokens: Values  # tokens per second
    gpu_bytes: Values
    cpu_bytes: Values
    kv_host_bytes: Values  # the part of cpu_bytes that is the host KV cache
    gpu_compute: Values  # the device's stages alone, per layer (gpu: that, bounded by or plus the issue)
    issue: Values  # the host's time to issue the layer (CostModel._issue)


def _pick(
    ops: _Ops, kernels: tuple[KernelRoof, ...], flops: Values, weights: Values, peak: float, bw: float
) -> tuple[Values, Values, tuple[Values, Values]]:
    """The stage's time by the fastest kernel (the first of the fastest, as the services pick by
    measuring), that kernel's index, and the work as the dense roofs see it (flops over the kernel's
    share of the peak, the bytes it moves). Ranked by the stage's own roof: KernelRoof.seconds groups
    the division differently, the same ranking for shares of the peak that are powers of 2 (1, 0.25)."""
    first, *others = kernels
    work = flops / first.flops, weights * first.traffic
    best, idx = ops.maximum(work[0] / peak, work[1] / bw), 0
    for i, kernel in enumerate(others, 1):
        f, nbytes = flops / kernel.flops, weights * kernel.traffic
        t = ops.maximum(f / peak, nbytes / bw)
        faster = t < best
        best, idx = ops.where(faster, t, best), ops.where(faster, i, idx)
        work = (ops.where(faster, f, work[0]), ops.where(faster, nbytes, work[1]))
    return best, idx, work


class CostModel:
    """What every policy of one (spec, workload, machine, dtypes, headroom, page format, KV rule)
    shares, derived once; layer() adds the policy. `dtype`: the weights' (default the spec's), also the
    device KV cache's; `kv_dtype`: the host KV cache's format (cpu_attention's --kv-dtype: a float
    dtype or int8, kv_format.py; default the weights'); `kv_rule`: how the KV of N sequences is
    counted against memory (kv_tokens())."""

    def __init__(
        self,
        spec: ModelSpec,
        work: Workload,
        hw: HardwareProfile,
        dtype: str | None,
        headroom: Headroom,
        kv_dtype: str | None = None,
        quant: QuantScheme = NO_QUANT,
        kv_rule: str = EXPECTED_USE,
    ) -> None:
        self.spec, self.work, self.hw, self.quant = spec, work, hw, quant
        self.headroom, self.kv_rule = headroom, check_kv_rule(kv_rule)
        self.b = b = dtype_bytes(dtype or spec.dtype)
        self.kv_format = kv_dtype or (dtype or spec.dtype)
        self.w = weight_bytes(spec, b, quant)
        page_bpw = page_bytes_per_weight(spec, b, quant)
        self.kv_host_token = kv_token_bytes(spec, self.kv_format)  # K and V of one token in one layer, host cache
        self.kv_device_token = spec.kv_tensors * spec.kv_size * b  # ... device cache (in the weights' dtype)
        # taken by need, sliding layers hold only their window's K/V; reserved, every layer's context
        self.held_share = 1.0 if self.kv_rule == MAX_CONTEXT else spec.attended_share(work.avg_context)
        self.total_experts = spec.total_experts
        self.kernels = {  # one machine: the expert GEMM's calibrated roofs are the device-side ones
            "gpu_experts": expert_kernels(hw, quant, b, page_bpw, True),
            "cpu_experts": expert_kernels(hw, quant, b, page_bpw, hw.shared_host_device),
        }
        self.gpu_capacity = headroom.gpu * (hw.cpu_memory if hw.shared_host_device else hw.gpu_memory)
        self.cpu_capacity = headroom.cpu * hw.cpu_memory

    def _distinct(self, tokens: Values) -> Values:
        """distinct_experts() per element, its power by Python's (see the module's docstring). Tokens
        per group, N / g, need not be whole, so a grid's are floats: Python's power of float(t) is its
        power of int(t) for a whole t, so they agree with the scalar policy's int mu as well."""
        if not isinstance(tokens, np.ndarray):
            return distinct_experts(tokens, self.spec)
        values, inverse = np.unique(tokens, return_inverse=True)
        touched = np.array([distinct_experts(float(t), self.spec) for t in values.ravel()])
        return touched[inverse].reshape(np.shape(tokens))

    def layer(
        self,
        n: npt.ArrayLike,
        mu: npt.ArrayLike,
        att_gpu: npt.ArrayLike,
        exp_gpu: npt.ArrayLike,
        resident: npt.ArrayLike,
        r_c: npt.ArrayLike,
        overlap: bool = True,
        groups: npt.ArrayLike = 0,
    ) -> LayerCost:
        """N, mu, attention on the device?, experts on the device?, resident pages (of L x E), share of
        the KV cache on the device, groups of micro-batches whose experts run at once (0: once per
        micro-batch): scalars or arrays that broadcast. `overlap=False`: the overlap-off baseline
        schedule (gpu_expert --no-overlap: every stage waits for the one before, a layer's experts
        copied when it starts), where the resources' times add up and nothing is grouped."""
        policy = (n, mu, att_gpu, exp_gpu, resident, r_c, groups)
        if not any(isinstance(v, np.ndarray) for v in policy):
            return self._layer(
                SCALARS,
                int(n),
                int(mu),
                bool(att_gpu),
                bool(exp_gpu),
                int(resident),
                float(r_c),
                int(groups),
                overlap,
            )
        types = (np.int64, np.int64, bool, bool, np.int64, np.float64, np.int64)
        args = [np.asarray(v, dtype=t) for v, t in zip(policy, types, strict=True)]
        return self._layer(ARRAYS, *args, overlap)

    def _layer(
        self,
        ops: _Ops,
        n: Any,
        mu: Any,
        att_gpu: Any,
        exp_gpu: Any,
        resident: Any,
        r_c: Any,
        groups: Any,
        overlap: bool,
    ) -> LayerCost:
        spec, hw, w, b = self.spec, self.hw, self.w, self.b
        shared = hw.shared_host_device
        n_ub = n // mu
        g = ops.where((groups > 0) & (groups < n_ub), groups, n_ub) if overlap else n_ub
        group_tokens = ops.where(g < n_ub, n / g, mu)  # one micro-batch's mu where nothing is grouped
        h1, h2, k, q, kv = spec.hidden_size, spec.intermediate_size, spec.top_k, spec.q_size, spec.kv_size
        # a sliding layer reads only its window: the layers' mean context
        layers, ctx = spec.num_layers, self.work.avg_context * spec.attended_share(self.work.avg_context)
        f = sparse_share(spec)
        total = self.total_experts
        resident = ops.minimum(resident, total)
        streamed = (total - resident) / layers  # per layer, on average
        # experts on the CPU: the non-resident ones compute on the host where they live, resident ones
        # still on the device; on the GPU every expert computes there and the non-resident ones stream
        host_share = ops.where(exp_gpu, 0.0, (total - resident) / total)
        on_device, on_host = host_share < 1.0, host_share > 0.0
        buffered = ops.ceil((total - resident) / spec.num_sparse_layers)  # the most a layer streams
        gpu_roofs, cpu_roofs = (hw.gpu_flops, hw.gpu_bandwidth), (hw.cpu_flops, hw.cpu_bandwidth)
        stages: dict[str, Stage] = {}

        def roof(
            stage: str, flops: Values, nbytes: Values, roofs: tuple[float, float], present: Any, share: float = 1.0
        ) -> None:
            seconds = ops.maximum(flops / roofs[0], nbytes / roofs[1]) * share
            stages[stage] = Stage(seconds, present, (flops * share, nbytes * share))

        # --- device: dense projections, router, (experts), (attention), head amortised per layer -----
        attn_weights = spec.attention_params() if spec.attention == "mla" else h1 * (q + 2 * kv) + q * h1
        dense_flops = 2 * n * attn_weights
        dense_flops = dense_flops + 2 * n * (f * (h1 * spec.num_experts + 3 * h1 * spec.shared_expert_size))
        dense_flops = dense_flops + 2 * n * (1 - f) * 3 * h1 * spec.dense_intermediate_size
        roof("gpu_dense", dense_flops, n_ub * w["layer_dense"], gpu_roofs, True)  # each micro-batch re-reads
        expert_flops = 2 * n * k * 3 * h1 * h2 * f
        expert_weights = 3 * h1 * h2 * f  # weights of one expert, averaged over the layers
        chosen: dict[str, Values] = {}  # expert stage -> its kernel's index
        host_roofs = gpu_roofs if shared else cpu_roofs
        touched = self._distinct(group_tokens)  # experts an FFN pass computes
        for stage, weights, roofs, present, share in (
            ("gpu_experts", g * touched * expert_weights, gpu_roofs, on_device, 1 - host_share),
            # the host's experts run in the same FFN passes (gpu_expert's runner): each needed one read
            # once per micro-batch, or per group of them, as the device's are
            ("cpu_experts", g * touched * expert_weights, host_roofs, on_host, host_share),
        ):
            seconds, chosen[stage], (kflops, kbytes) = _pick(ops, self.kernels[stage], expert_flops, weights, *roofs)
            stages[stage] = Stage(seconds * share, present, (kflops * share, kbytes * share))
        if shared:  # one memory: "streaming" is a memcpy that reads and writes every streamed expert each step
            copy = exp_gpu & (streamed != 0)
            stages["gpu_expert_copy"] = Stage(2 * streamed * w["expert"] / hw.gpu_bandwidth, copy)
        attn_flops = 4 * n * ctx * q
        roof("cpu_attention", attn_flops, n * ctx * self.kv_host_token, cpu_roofs, ops.invert(att_gpu))
        roof("gpu_attention", attn_flops, n * ctx * self.kv_device_token, gpu_roofs, att_gpu)
        head_bytes = spec.vocab_size * h1 * b
        roof("gpu_head", 2 * n * h1 * spec.vocab_size, head_bytes, gpu_roofs, True, share=1 / layers)

        # --- link: streamed experts, activations to/from CPU stages, KV when attention is on GPU ------
        def over_link(stage: str, nbytes: Values, bandwidth: float, present: Any) -> None:
            stages[stage] = Stage(nbytes / bandwidth, present, link_bytes=nbytes)

        if shared:
            # a CPU device behind a simulated link: only the expert pages are held to the link's rate
            # (the hand-offs stay in shared memory); the memcpy above still takes the shared cores' time
            over_link("link_weights", streamed * w["expert"], hw.h2d_bandwidth, copy & hw.simulated_link)
        else:
            over_link("link_weights", streamed * w["expert"], hw.h2d_bandwidth, exp_gpu)
            over_link("link_experts_io", 2 * n * h1 * b, hw.h2d_bandwidth, ops.invert(exp_gpu) & on_host)
            over_link("link_qkv", n * (q + 2 * kv) * b, hw.d2h_bandwidth, ops.invert(att_gpu))
            over_link("link_attn_out", n * q * b, hw.h2d_bandwidth, ops.invert(att_gpu))
            over_link("link_kv", (1 - r_c) * n * ctx * self.kv_host_token, hw.h2d_bandwidth, att_gpu)

        gpu, cpu, link, layer, tokens, compute, issue = self._times(ops, stages, n, n_ub, g, touched, overlap)

        gpu_bytes, cpu_bytes, kv_host_bytes = self._memory(
            ops, n, mu, g, att_gpu, exp_gpu, resident, r_c, buffered, stages, chosen
        )
        return LayerCost(
            stages, chosen, gpu, cpu, link, layer, tokens, gpu_bytes, cpu_bytes, kv_host_bytes, compute, issue
        )

    def _times(
        self, ops: _Ops, stages: dict[str, Stage], n: Any, n_ub: Any, g: Any, touched: Values, overlap: bool
    ) -> tuple[Values, ...]:
        """gpu, cpu, link, layer seconds, tokens/s, and the device's compute and issue time (adds the
        stage gpu_issue). A GPU's time is max(compute, issue): the host issues ahead of the device, so
        the layer ends no sooner than either is done and launches hide behind work while the host
        keeps ahead: a pipeline's roofline (left out: each FFN pass's sync idles the device for some
        microseconds). A CPU device's cores run the calls' fixed cost and the compute in turn: their
        sum. Overlap off keeps that device time; only the resources' times add there."""
        shared, layers = self.hw.shared_host_device, self.spec.num_layers
        # each resource sums its stages in order; a stage the policy lacks adds an exact 0
        totals = {"gpu": 0.0, "cpu": 0.0, "link": 0.0}
        for name, stage in stages.items():
            side = name.split("_", 1)[0]
            totals[side] = totals[side] + ops.where(stage.present, stage.seconds, 0.0)
        gpu, cpu, link = totals["gpu"], totals["cpu"], totals["link"]
        issue = self._issue(n_ub, g, touched)
        stages["gpu_issue"] = Stage(issue, issue > 0)  # not in the sum above: it bounds it
        compute = gpu
        gpu = gpu + issue if shared else ops.maximum(gpu, issue)
        # Shared host/device: one set of cores and one memory, so compute never overlaps compute; a
        # simulated link still runs beside it. Otherwise CGOPipe hides the smaller of CPU and GPU work
        # behind the other only across micro-batches (groups of them): one group's share of it stays
        # exposed (pipeline fill), all of it when g = 1. With overlap off nothing hides anything.
        if not overlap:
            layer = gpu + cpu + link
        elif shared:
            layer = ops.maximum(gpu + cpu, link)
        else:
            layer = ops.maximum(ops.maximum(gpu, cpu), link) + (gpu + cpu - ops.maximum(gpu, cpu)) / g
        running = layer > 0
        tokens = ops.where(running, n / ops.where(running, layer * layers, 1.0), math.inf)
        return gpu, cpu, link, layer, tokens, compute, issue

    def _issue(self, n_ub: Any, g: Any, touched: Values) -> Values:
        """Host time to issue one layer (hrm/host_issue.py): each micro-batch's per-token stages, and g
        FFN passes (one a micro-batch, or one a group of them), each its fixed part and the experts it
        computes: the routed ones it touches and a shared expert in a sparse layer, the MLP in a dense
        one (averaged over the layers, as the rest of the formula is). Where the experts compute (the
        device, the host) does not matter: the host issues the loop over them either way. Device
        attention issues its own kernels instead of the hand-off's: counted as the hand-off's."""
        hw, f = self.hw, sparse_share(self.spec)
        experts = touched + (1.0 if self.spec.shared_expert_size else 0.0)
        per_pass = f * (hw.host_ffn_seconds + experts * hw.host_expert_seconds) + (1 - f) * hw.host_expert_seconds
        return n_ub * hw.host_micro_batch_seconds + g * per_pass

    def _memory(
        self,
        ops: _Ops,
        n: Any,
        mu: Any,
        g: Any,
        att_gpu: Any,
        exp_gpu: Any,
        resident: Any,
        r_c: Any,
        buffered: Any,
        stages: dict[str, Stage],
        chosen: dict[str, Values],
    ) -> tuple[Values, Values, Values]:
        """The policy's device bytes, host bytes and the host KV cache's part of those."""
        spec, w, b, shared, layers = self.spec, self.w, self.b, self.hw.shared_host_device, self.spec.num_layers
        h1, h2, k, q, kv = spec.hidden_size, spec.intermediate_size, spec.top_k, spec.q_size, spec.kv_size
        n_ub = n // mu
        dense_all = layers * w["layer_dense"] + w["embed_head"]
        held = kv_tokens(n, self.work, self.kv_rule, self.headroom, ops)  # the batch's KV tokens, by the rule
        kv_device = held * self.kv_device_token * layers * self.held_share
        # whole numbers, exact in both paths: a group's FFN holds its micro-batches' expert intermediates
        ffn_tokens = -(-n_ub // g) * mu
        activations = mu * (4 * h1 + q + 2 * kv) * 4 + ffn_tokens * (2 * h2 * k) * 4 + mu * spec.vocab_size * 4
        # a kernel's per-call copies of the largest expert linear (w13, 2I x D): dequantized or
        # repacked (one call at a time: the largest kernel's, on the side it runs)
        scratch = {
            stage: ops.where(stages[stage].present, ops.take(self._scratch(stage, 2 * h2 * h1), chosen[stage]), 0.0)
            for stage in chosen
        }
        device_scratch = scratch["gpu_experts"]
        if shared:
            device_scratch = ops.maximum(device_scratch, scratch["cpu_experts"])
        activations = activations + device_scratch
        gpu_bytes = dense_all + activations
        gpu_bytes = gpu_bytes + resident * w["expert"]
        # double buffer for one layer's streamed experts
        gpu_bytes = gpu_bytes + ops.where(exp_gpu & (buffered != 0) & (not shared), 2 * buffered * w["expert"], 0.0)
        device_kv = r_c * kv_device + mu * self.work.max_context * self.kv_device_token
        gpu_bytes = gpu_bytes + ops.where(att_gpu, device_kv, 0.0)
        kv_host_bytes = (1 - r_c) * (held * self.kv_host_token * layers * self.held_share)
        cpu_bytes = spec.num_sparse_layers * w["layer_experts"] + dense_all + kv_host_bytes
        cpu_bytes = cpu_bytes + n * (q * 2 + 2 * kv) * b * 2  # staging for hand-offs
        if shared:  # one memory: count it once, against the host
            cpu_bytes = cpu_bytes + (activations + ops.where(att_gpu, r_c * kv_device, 0.0))
            gpu_bytes = cpu_bytes
        else:
            cpu_bytes = cpu_bytes + scratch["cpu_experts"]
        return gpu_bytes, cpu_bytes, kv_host_bytes

    def _scratch(self, stage: str, weights: int) -> list[float]:
        """Each of the stage's kernels' scratch for a linear of `weights` weights."""
        return [kernel.scratch_bytes(weights) for kernel in self.kernels[stage]]
