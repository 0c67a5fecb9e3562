"""The host's side of a decode step: how long the host takes to issue one micro-batch of one layer.

On CUDA the host issues every kernel of a step: per (layer, micro-batch) the pre-attention
projections, the hand-off's copies and events, the attention output, the router, the sort of the
routed tokens and, per expert the micro-batch routed to, its GEMMs, activation and weighted sum
(~100-120 launches for a Mixtral micro-batch that touches all 8 experts), plus the one device sync that
remains (experts_forward reads the tokens-per-expert counts back to slice them). The device cannot
finish a layer before the host has issued it, whatever its roofs, so the cost model bounds the
device's time by the issue time (hrm/layercost.py). On a CPU device the same calls are the ops'
fixed per-call cost, which the roofs (measured on large operands) leave out.

What is measured: the real stage functions (stages/pre_attention, attention_output, ffn) on a tiny
Mixtral-shaped layer, in three parts that scale differently with the policy:

* per micro-batch: pre-attention, a stand-in for the hand-off (q/k/v out to pinned host memory on a
  copy stream after an event, the attention result back on another, as handoff_link.py does;
  copies into a slot on a CPU), the attention output (o_proj, residual, norm);
* per FFN pass (once per micro-batch, or once per group of them with expert groups): the router,
  the sort of the routed tokens and the sync on their counts;
* per expert an FFN pass computes: its slice of the tokens, two GEMMs, the activation, the weighted
  index_add.

Each is host wall time per call, the best of a few loops, with the operands so small that the device
keeps up with the launches: what is left is the host's time (launches, the sync's round trip). Two
layers, one with 2 experts and one with 8, each routed so that every expert gets tokens, separate the
pass's fixed part from the per-expert part. Other families issue a few more ops (q/k norms, biases, a
shared expert: each one more expert per pass in the cost model); the services' own host work besides
the stages (the hand-off's shared-memory channel, its publisher thread, the pager) is not included.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from moe_lightning.hrm.pages import random_experts
from moe_lightning.hrm.sizes import NO_QUANT
from moe_lightning.quant.kernel_choice import unpublished
from moe_lightning.quant.scheme import QuantScheme
from moe_lightning.spec import ModelSpec
from moe_lightning.stages import attention_output, ffn, pre_attention
from moe_lightning.weights import LayerWeights

# the tiny layer's width and heads: 8 experts' weights (~0.4 MB in fp32) stay in a CPU's L2, where a
# GEMM of a token over them takes a few microseconds, the order of an op's fixed cost; a GPU runs them
# far below a launch's time. Quantized pages are wider: int4's groups (up to 128) must divide the
# width, and the native int4 kernels take 128 columns at a time
WIDTH, QUANT_WIDTH, HEADS, KV_HEADS = 64, 128, 4, 2
FEW, MANY = 2, 8  # experts in the two layers the per-expert cost is read off (top-2: every one routed to)
MIN_LOOPS, MAX_LOOPS = 5, 200  # loops of a measurement, whatever its time budget


class HostIssue(NamedTuple):
    """Seconds of host time to issue, for one layer: a micro-batch's per-token stages; an FFN pass's
    fixed part; each expert the pass computes (HardwareProfile.host_*_seconds)."""

    micro_batch: float
    ffn: float
    expert: float

    def per_micro_batch(self, experts: float) -> float:
        """One micro-batch of one layer, its own FFN pass computing `experts` experts."""
        return self.micro_batch + self.ffn + experts * self.expert


def tiny_spec(experts: int, dtype: torch.dtype, width: int = WIDTH) -> ModelSpec:
    """A Mixtral-shaped layer (GQA, RMSNorm, RoPE, softmax top-2 router, SwiGLU experts), tiny."""
    return ModelSpec(
        architecture="MixtralForCausalLM",
        hidden_size=width,
        intermediate_size=width,
        num_layers=1,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=width // HEADS,
        num_experts=experts,
        top_k=2,
        vocab_size=16,
        dtype=str(dtype).removeprefix("torch."),
        eos_token_ids=(2,),
    )


def tiny_layer(spec: ModelSpec, device: torch.device, dtype: torch.dtype, quant: QuantScheme) -> LayerWeights:
    """Random weights for `spec`'s one layer, the experts' pages in `quant`'s format. The router is the
    identity on the first E dims, so a token's top-2 are the two dims the caller makes largest."""
    d, e = spec.hidden_size, spec.num_experts

    def dense(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device=device, dtype=dtype) * 0.02

    router = torch.zeros(e, d, device=device, dtype=dtype)
    router[:, :e] = torch.eye(e, device=device, dtype=dtype)
    ones = torch.ones(d, device=device, dtype=dtype)
    return LayerWeights(
        attn_norm=ones,
        wqkv=dense(spec.q_size + 2 * spec.kv_size, d),
        wo=dense(d, spec.q_size),
        ffn_norm=ones.clone(),
        router=router,
        experts=random_experts(device, dtype, d, spec.intermediate_size, e, quant),
    )


def routed_input(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(E/2, D): token t routed to experts 2t and 2t + 1 by tiny_layer's router, so every expert of
    the layer computes one token: the launches of a micro-batch that touches them all."""
    tokens = spec.num_experts // spec.top_k
    x = torch.randn(tokens, spec.hidden_size, device=device, dtype=dtype) * 0.01
    for t in range(tokens):
        x[t, 2 * t : 2 * t + 2] = 1.0
    return x


class _Handoff:
    """What gpu_expert's side of the hand-off issues per micro-batch (services/gpu_expert/handoff_link.py):
    on CUDA, q/k/v copied to pinned host memory on a copy stream after an event, the result copied back
    on another stream the compute stream waits for, the previous result's event synchronized; on a CPU,
    q/k/v copied into the channel's slot and the result used in place."""

    def __init__(self, spec: ModelSpec, tokens: int, device: torch.device, dtype: torch.dtype) -> None:
        self.cuda = device.type == "cuda"
        pinned = {"pin_memory": True} if self.cuda else {}
        sizes = (spec.q_size, spec.kv_size, spec.kv_size)
        self.slots = [torch.empty(tokens, n, dtype=dtype, **pinned) for n in sizes]
        self.result = torch.randn(tokens, spec.q_size, dtype=dtype, **pinned)
        self.device = device
        self.held: torch.cuda.Event | None = None
        if self.cuda:
            self.d2h, self.h2d = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def send(self, qkv: tuple[torch.Tensor, ...]) -> None:
        if not self.cuda:
            for dst, src in zip(self.slots, qkv, strict=True):
                dst.copy_(src.reshape(dst.shape))
            return
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(produced)
            for dst, src in zip(self.slots, qkv, strict=True):
                dst.copy_(src.reshape(dst.shape), non_blocking=True)
                src.record_stream(self.d2h)
            torch.cuda.Event().record(self.d2h)

    def receive(self) -> torch.Tensor:
        if not self.cuda:
            return self.result
        if self.held is not None:
            self.held.synchronize()  # the previous result's copy, issued a micro-batch ago
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.h2d):
            out = torch.empty(self.result.shape, dtype=self.result.dtype, device=self.device)
            out.copy_(self.result, non_blocking=True)
            self.held = torch.cuda.Event()
            self.held.record(self.h2d)
        compute.wait_event(self.held)
        out.record_stream(compute)
        return out


def _host_seconds(fn: Callable[[], object], device: torch.device, iterations: int, budget: float) -> float:
    """Host wall time per call of `fn`: the best mean of short loops of `iterations` calls, as many
    loops as `budget` seconds allow (at least MIN_LOOPS). Short loops, many of them: on a busy host
    some run unpreempted, and the best is the calls' own cost. The device is drained before each
    loop and at its end (a tail of tiny kernels, spread over the loop)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _: None)
    for _ in range(3):  # warm-up: the CPU kernels' races, CUDA's lazy initialisation
        fn()
    best, loops, deadline = math.inf, 0, time.perf_counter() + budget
    while loops < MIN_LOOPS or (loops < MAX_LOOPS and time.perf_counter() < deadline):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iterations):
            fn()
        sync(device)
        best = min(best, (time.perf_counter() - t0) / iterations)
        loops += 1
    return best


def host_issue_seconds(
    device: torch.device | str,
    dtype: torch.dtype,
    quant: QuantScheme = NO_QUANT,
    iterations: int = 5,
    budget: float = 0.3,
) -> HostIssue:
    """Measures the three parts of the host's issue time on `device` (see the module's docstring),
    expert pages in `quant`'s format: loops of `iterations` calls for about `budget` seconds each,
    ~1 s in all with the warm-up (longer only where MIN_LOOPS loops take longer)."""
    dev = torch.device(device)
    threads = torch.get_num_threads()
    # one intra-op thread: the ops are too small to split, and a pool that waits on a busy host's
    # scheduler for its other threads measured that scheduler (ms a call on a loaded 2-core VM)
    torch.set_num_threads(1)
    try:
        with unpublished():  # the tiny layer's shapes are not the model's: their kernel choices stay private
            return _measure(dev, dtype, quant, iterations, budget)
    finally:
        torch.set_num_threads(threads)


def _measure(dev: torch.device, dtype: torch.dtype, quant: QuantScheme, iterations: int, budget: float) -> HostIssue:
    with torch.inference_mode():  # as gpu_expert runs its steps: no autograd bookkeeping per op
        width = QUANT_WIDTH if quant.quantized else WIDTH
        few, many = tiny_spec(FEW, dtype, width), tiny_spec(MANY, dtype, width)
        layers = {FEW: tiny_layer(few, dev, dtype, quant), MANY: tiny_layer(many, dev, dtype, quant)}
        inputs = {FEW: routed_input(few, dev, dtype), MANY: routed_input(many, dev, dtype)}
        hidden = inputs[MANY]
        tokens = hidden.shape[0]
        positions = torch.arange(tokens, device=dev)
        handoff = _Handoff(many, tokens, dev, dtype)

        def micro_batch() -> None:
            handoff.send(pre_attention(many, layers[MANY], hidden, positions))
            attention_output(many, layers[MANY], hidden, handoff.receive())

        seconds = {}
        for e, spec in ((FEW, few), (MANY, many)):
            x = inputs[e]
            seconds[e] = _host_seconds(lambda s=spec, e=e, x=x: ffn(s, layers[e], x, x), dev, iterations, budget)
        per_mb = _host_seconds(micro_batch, dev, iterations, budget)
    # noise on a busy host can invert the two layers' times: neither part is negative
    expert = max(0.0, (seconds[MANY] - seconds[FEW]) / (MANY - FEW))
    return HostIssue(per_mb, max(0.0, seconds[FEW] - FEW * expert), expert)
