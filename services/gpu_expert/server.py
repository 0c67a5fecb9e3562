"""gpu_expert: owns the device; maps the weight arena; runs pre-attention, post-attention (router
and experts) and the head for each step the orchestrator sends; returns the sampled tokens."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import grpc
import torch
from prometheus_client import Gauge

from moe_lightning.api.gpu_expert.v1 import gpu_expert_pb2, gpu_expert_pb2_grpc
from moe_lightning.arena import weights_from_arena
from moe_lightning.flags import (
    EnvDefaultsParser,
    add_kernel_flags,
    add_service_flags,
    add_worker_flags,
    internal_address,
    parse_size,
)
from moe_lightning.handoff import handoff_slot_bytes
from moe_lightning.hrm.calibrate import Measurements, cached_measurements, expert_side_key, measure_expert_side
from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.quant import kernels
from moe_lightning.service.convert import (
    DTYPE_FROM_PB,
    layout_from_pb,
    measurements_to_pb,
    step_output_to_pb,
    step_plan_from_pb,
)
from moe_lightning.service.errors import NotReadyError
from moe_lightning.service.names import GPU_EXPERT
from moe_lightning.service.runtime import ServiceRuntime, serve
from moe_lightning.service.upstream import fetch_manifest
from moe_lightning.shm import Segment, TensorChannel, segment_name
from moe_lightning.spec import DTYPES, ModelSpec
from moe_lightning.timeline import TimelineRecorder
from services.gpu_expert.handoff_link import HandoffLink
from services.gpu_expert.memory import default_budget
from services.gpu_expert.pager import ExpertPager
from services.gpu_expert.pinned import pin_host_memory, unpin_host_memory
from services.gpu_expert.residency import DeviceBudgetError, ResidencyPlan, plan_residency
from services.gpu_expert.runner import ExpertRunner

STEP_EXIT_WAIT = 10.0  # seconds cleanup waits for a running step
# the host's experts on a GPU box: only if the plan places experts there, where each GEMM is slow
HOST_WARM_UP_ROWS = 64
DEVICE_BYTES = Gauge("moe_lightning_device_weight_bytes", "Weight bytes held on the device")
DEVICE_BUDGET = Gauge("moe_lightning_device_memory_budget_bytes", "--device-memory")
RESIDENT = Gauge("moe_lightning_resident_experts", "Expert pages kept on the device (of layers x experts)")
BUFFER_SLOTS = Gauge("moe_lightning_expert_buffer_slots", "Buffer slots (one expert each) for streamed experts")


class GpuExpertServicer(gpu_expert_pb2_grpc.GpuExpertServicer):
    def __init__(self) -> None:
        self._runner: ExpertRunner | None = None
        self.device = ""
        self.weight_bytes = 0
        self.budget = 0
        self.measurements: Measurements | None = None
        self.residency: ResidencyPlan | None = None
        self.max_handoff_tokens = 0
        self.step_lock = threading.Lock()  # one step at a time: the channels carry one step's hand-offs

    def ready(
        self,
        runner: ExpertRunner,
        *,
        device: str,
        weight_bytes: int,
        budget: int,
        measurements: Measurements,
        residency: ResidencyPlan,
        max_handoff_tokens: int,
    ) -> None:
        """Weights are mapped and calibrated: steps reach `runner` from now on."""
        self.device, self.weight_bytes, self.budget = device, weight_bytes, budget
        self.measurements, self.residency = measurements, residency
        self.max_handoff_tokens = max_handoff_tokens
        self._runner = runner  # last: a call that finds the runner finds the rest set

    @property
    def runner(self) -> ExpertRunner:
        if self._runner is None:
            raise NotReadyError("gpu_expert is still mapping weights; retry when health is SERVING")
        return self._runner

    def Describe(
        self, request: gpu_expert_pb2.DescribeRequest, context: grpc.ServicerContext
    ) -> gpu_expert_pb2.DescribeResponse:
        return gpu_expert_pb2.DescribeResponse(
            device=self.device,
            weight_bytes=self.weight_bytes,
            device_memory_bytes=self.budget,
            output_channel=self.runner.link.output.name,
            measurements=measurements_to_pb(self.measurements) if self.measurements else None,
            device_kv_blocks=self.runner.kv.allocator.num_blocks if self.runner.kv is not None else 0,
            device_kv_block_size=self.runner.kv.block_size if self.runner.kv is not None else 0,
            resident_experts=sum(len(r) for r in self.residency.resident) if self.residency else 0,
            expert_ring_slots=self.residency.ring_slots if self.residency else 0,
            max_handoff_tokens=self.max_handoff_tokens,
        )

    def Connect(
        self, request: gpu_expert_pb2.ConnectRequest, context: grpc.ServicerContext
    ) -> gpu_expert_pb2.ConnectResponse:
        with self.step_lock:
            self.runner.connect(request.input_channel, request.session)
        return gpu_expert_pb2.ConnectResponse()

    def Step(self, request: gpu_expert_pb2.StepRequest, context: grpc.ServicerContext) -> gpu_expert_pb2.StepResponse:
        t0 = time.perf_counter_ns()
        plan = step_plan_from_pb(request)
        with self.step_lock:
            out = self.runner.step(plan)
        out.timings.handler = time.perf_counter_ns() - t0  # the step plus its protobuf conversion
        return step_output_to_pb(out)


def build_parser() -> EnvDefaultsParser:
    p = EnvDefaultsParser(prog="moe-lightning-gpu-expert", description=__doc__)
    add_service_flags(p, internal_address("gpu_expert"))
    p.add_argument("--weight-store", required=True, help="address of the weight store")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:N]")
    p.add_argument(
        "--device-memory",
        type=parse_size,
        default=None,
        help="device memory budget for weights and the device KV cache, e.g. 16GiB (default: the device's free "
        "memory less what the CUDA runtime, the activations of the largest micro-batch and the head need)",
    )
    p.add_argument(
        "--device-kv-memory",
        type=parse_size,
        default=0,
        help="device memory for a KV cache, so the policy may place attention on the device (default 0: never)",
    )
    p.add_argument("--block-size", type=int, default=16, help="device KV cache block size in tokens")
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="baseline schedule: copy each layer's experts when needed, one micro-batch at a time",
    )
    add_worker_flags(p)
    add_kernel_flags(p)
    p.add_argument(
        "--residency-interval",
        type=int,
        default=256,
        help="decode steps between hot-expert residency updates when experts stream (0 = never)",
    )
    p.add_argument(
        "--count-syncs",
        action="store_true",
        help="count the host's synchronisations with the device in each step (CUDA; for checks: "
        "moe_lightning_cuda_syncs_total, slower)",
    )
    return p


def _device_kv_cache(
    spec: ModelSpec, device: torch.device, dtype: torch.dtype, nbytes: int, block_size: int
) -> PagedKVCache | None:
    """A KV cache on the device for attention placed there, in the weights' compute dtype."""
    if nbytes <= 0:
        return None
    blocks = PagedKVCache.blocks_in(nbytes, spec, block_size, dtype, "--device-kv-memory")
    return PagedKVCache(spec, blocks, block_size, dtype=dtype, device=device)


def _start(args: argparse.Namespace, servicer: GpuExpertServicer, runtime: ServiceRuntime) -> dict[str, Any]:
    """Maps the arena, plans what stays on the device, calibrates; the fields of the `serving` line."""
    log = runtime.log
    device = torch.device(args.device)
    spec, manifest = fetch_manifest(args.weight_store, stop=runtime)
    layout = layout_from_pb(list(manifest.pages), manifest.region_bytes)
    itemsize = DTYPES[DTYPE_FROM_PB[manifest.pages[0].dtype]].itemsize
    budget, reserve = default_budget(device, spec, args.max_tokens_per_handoff, itemsize)
    if args.device_memory is not None:
        if device.type == "cuda" and args.device_memory > budget:
            log.warning("device_memory_above_free", asked=args.device_memory, free_less_reserve=budget)
        budget = args.device_memory
    elif reserve:
        log.info("device_memory_default", budget=budget, kept_back=reserve)
    first = spec.experts_per_layer.index(spec.num_experts)  # the first sparse layer
    expert_bytes = layout.expert_page_bytes(first)  # what one streamed expert moves (its scales included)
    dense_bytes = layout.total_bytes - spec.total_experts * expert_bytes
    weight_budget = budget - args.device_kv_memory
    shape = (spec.num_layers, spec.num_experts, expert_bytes, dense_bytes, weight_budget)
    try:
        residency = plan_residency(*shape, dense_layers=spec.dense_layers)
    except DeviceBudgetError as exc:  # no room to stream: what does not fit can still run on the host
        residency = plan_residency(*shape, stream=False, dense_layers=spec.dense_layers)
        log.warning("no_streaming_buffer", reason=str(exc), experts_placement="host only")
    arena = Segment.attach(manifest.region)
    pinned = pin_host_memory(arena.bytes(), device)
    weights = weights_from_arena(arena.bytes(), layout, spec, device, experts_on_host=True)
    timeline = TimelineRecorder(args.timeline, "gpu_expert")
    pager = ExpertPager(weights, residency, device, timeline, lookahead=not args.no_overlap)
    kv = _device_kv_cache(spec, device, weights.layers[0].wo.dtype, args.device_kv_memory, args.block_size)
    output = TensorChannel.create(
        segment_name(args.run_id, "gpu_expert", "qkv"),
        args.handoff_slots,
        handoff_slot_bytes(spec, args.max_tokens_per_handoff, "qkv"),
    )
    link = HandoffLink(output, device)
    # as it computes: resident, else buffer slots, else on the host
    experts = list(pager.resident[first].values()) or pager.slots or list(weights.layers[first].experts)
    kernels.configure(args.expert_kernels)
    scheme = layout.expert_scheme()
    dtype = weights.layers[0].wo.dtype  # the dense weights': the experts' pages may be quantized
    if scheme.quantized:  # choose each shape's kernel now, on the weights as they compute
        kernels.warm_up([experts[0].w13, experts[0].w2], dtype)
        host = weights.layers[first].experts[0]  # computed where it lives, when experts are placed there
        if host.device != experts[0].device:  # decode-sized buckets now; more rows on first use
            kernels.warm_up([host.w13, host.w2], dtype, max_rows=HOST_WARM_UP_ROWS)
        log.info("kernels_chosen", experts=scheme.key(), choices=kernels.chooser().report())
    dense = [t for layer in weights.layers[:4] for t in (layer.wqkv, layer.wo)]
    measurements = cached_measurements(
        expert_side_key(device, dtype, spec, scheme),
        lambda: measure_expert_side(experts, str(device), budget, dtype=dtype, dense=dense, scheme=scheme),
        refresh=args.recalibrate,
        cache_dir=args.profile_cache,
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the calibration buffers' blocks go back to the device for activations
    log.info("calibrated", **{k: round(v) if isinstance(v, float) else v for k, v in asdict(measurements).items()})
    runner = ExpertRunner(
        spec,
        weights,
        device,
        link,
        pager,
        kv,
        residency_interval=args.residency_interval,
        timeline=timeline,
        overlap=not args.no_overlap,
        count_syncs=args.count_syncs,
    )
    RESIDENT.set(sum(len(r) for r in residency.resident))
    BUFFER_SLOTS.set(residency.ring_slots)
    log.info(
        "residency",
        resident_experts=sum(len(r) for r in residency.resident),
        of=spec.total_experts,
        ring_slots=residency.ring_slots,
        double_buffered=residency.double_buffered,
        device_kv_blocks=kv.allocator.num_blocks if kv is not None else 0,
        device_bytes=residency.device_bytes,
        budget=budget,
    )
    servicer.ready(
        runner,
        device=str(device),
        weight_bytes=layout.total_bytes,
        budget=budget,
        measurements=measurements,
        residency=residency,
        max_handoff_tokens=args.max_tokens_per_handoff,
    )
    DEVICE_BYTES.set(residency.device_bytes)
    DEVICE_BUDGET.set(budget)

    def cleanup() -> None:
        # a step may still run past the grace period: unregistering memory a copy is using would
        # fault it, so then the pinning is left to the process's exit
        idle = servicer.step_lock.acquire(timeout=STEP_EXIT_WAIT)
        if not idle:
            log.warning("step_still_running_at_exit", action="memory left pinned until exit")
        link.close(unpin=idle)
        pager.close()
        timeline.close()
        if pinned and idle:
            unpin_host_memory(arena.bytes(), device)
        arena.close()

    runtime.on_shutdown(cleanup)
    return {"device": str(device), "weight_bytes": layout.total_bytes, "output_channel": output.name}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    servicer = GpuExpertServicer()
    return serve(
        args,
        "gpu_expert",
        GPU_EXPERT,
        gpu_expert_pb2_grpc.add_GpuExpertServicer_to_server,
        servicer,
        lambda runtime: _start(args, servicer, runtime),
    )


if __name__ == "__main__":
    sys.exit(main())
