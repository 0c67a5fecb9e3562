"""What one gpu_expert rank builds at start: its device, its slice of the weights mapped from the
arena, what stays on its device, its kernels and roofs measured, and the runner. Rank 0 (the
service, server.py) and every other rank (follower.py) build alike."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
import torch

from moe_lightning.api.weight_store.v1 import weight_store_pb2
from moe_lightning.arena import ArenaLayout, weights_from_arena
from moe_lightning.config.checks import DeviceBudgetError, share_budget
from moe_lightning.config.gpu_expert import GpuExpertConfig
from moe_lightning.config.units import DeviceShare
from moe_lightning.handoff import handoff_slot_bytes
from moe_lightning.hrm.calibrate import cached_measurements, expert_side_key, measure_expert_side
from moe_lightning.hrm.roofs import Measurements, simulated_link
from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.quant import kernels
from moe_lightning.quant.dense import quantize_dense
from moe_lightning.service.convert import DTYPE_FROM_PB
from moe_lightning.shm.channel import TensorChannel
from moe_lightning.shm.segment import Segment, segment_name
from moe_lightning.spec import ModelSpec
from moe_lightning.tensor_parallel import Shard, rank_spec
from moe_lightning.timeline import TimelineRecorder
from moe_lightning.torch_dtypes import DTYPES
from moe_lightning.weights import ModelWeights
from services.gpu_expert.copy_engine import make_copy_engine
from services.gpu_expert.handoff_link import HandoffLink
from services.gpu_expert.memory import cap_device_memory, capped_reserve, default_budget
from services.gpu_expert.pager import ExpertPager
from services.gpu_expert.pinned import pin_host_memory, unpin_host_memory
from services.gpu_expert.ranks import RankGroup
from services.gpu_expert.residency import ResidencyPlan, plan_residency
from services.gpu_expert.runner import ExpertRunner

# the host's experts on a GPU box, where each GEMM is slow: decode-sized buckets at start, more on use
HOST_WARM_UP_ROWS = 64


@dataclass
class Worker:
    runner: ExpertRunner
    device: torch.device
    budget: int
    measurements: Measurements
    residency: ResidencyPlan
    weight_bytes: int  # this rank's: its slice of the model
    output: TensorChannel | None  # rank 0's hand-off channel to cpu_attention
    closers: list[Callable[[bool], None]] = field(default_factory=list)
    timeline: TimelineRecorder = field(default_factory=lambda: TimelineRecorder(None, "gpu_expert"))

    def close(self, idle: bool) -> None:
        """`idle`: no step runs, so memory a copy may use can be unpinned."""
        for fn in reversed(self.closers):
            fn(idle)


def rank_device(device: str, shard: Shard, same_device: bool = False) -> torch.device:
    """Rank r of a group on `cuda` (or `cuda:i`) takes the r-th device from there; on a CPU, or with
    `same_device` (--tp-same-device: a check of several ranks on one GPU), all share `device`. A CUDA
    device always comes back with its index: `torch.cuda.set_device` (claim_device) refuses a bare
    `cuda`, and a bare one would name whichever device is current, not the rank's."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    shared = shard.world == 1 or same_device
    index = (base.index or 0) + (0 if shared else shard.rank)
    visible = torch.cuda.device_count()
    if index >= visible:
        who = f"rank {shard.rank} of {shard.world}" if not shared else "this process"
        raise ValueError(
            f"{who} needs cuda:{index}, but {visible} CUDA device(s) are visible from {device}: run fewer "
            f"--gpus (or --tp-same-device with --tp-backend gloo)"
        )
    return torch.device("cuda", index)


def host_warm_up_rows(placement: str, residency: ResidencyPlan, host_apart: bool) -> int:
    """Rows up to which the host's quantized-expert kernels are chosen at start (0: none). Only when
    experts will compute on the host of a device apart from it: `--experts-placement cpu`, or no room
    to stream (the host is then the only place a non-resident expert can run). Racing them otherwise
    costs 20-60 s per start for experts that stream; should the orchestrator's planner (auto) place
    them on the host later, the chooser picks each shape's kernel on its first use there."""
    if not host_apart or all(len(r) == n for r, n in zip(residency.resident, residency.experts_per_layer, strict=True)):
        return 0  # on a CPU device the host's kernels are the device's (warmed anyway); or nothing is on the host
    return HOST_WARM_UP_ROWS if placement == "cpu" or residency.ring_slots == 0 else 0


def step_dense_weights(weights: ModelWeights) -> list[torch.Tensor]:
    """The dense weights a step multiplies by (dense_linear): projections, routers, dense FFNs, the LM
    head; kernels.warm_up keeps one per shape."""
    out = [weights.lm_head]
    for layer in weights.layers:
        out += [t for t in (layer.wqkv, layer.wo, layer.router, layer.shared_gate) if t is not None]
        for mlp in (layer.shared, layer.mlp):
            if mlp is not None:
                out += [w for w in (mlp.w13, mlp.w2) if isinstance(w, torch.Tensor)]
    return out


def claim_device(device: torch.device) -> None:
    """Makes `device` this process's current one, before anything allocates or a group forms: a rank's
    CUDA context (and NCCL's guess of its device) then lives on its own GPU, not on cuda:0."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _device_kv_cache(
    spec: ModelSpec, device: torch.device, dtype: torch.dtype, nbytes: int, block_size: int
) -> PagedKVCache | None:
    """A KV cache on the device for attention placed there, in the weights' compute dtype (of the
    rank's KV heads)."""
    if nbytes <= 0:
        return None
    blocks = PagedKVCache.blocks_in(nbytes, spec, block_size, dtype, "--device-kv-memory")
    return PagedKVCache(spec, blocks, block_size, dtype=dtype, device=device)


def _budget(config: GpuExpertConfig, device: torch.device, spec: ModelSpec, itemsize: int, head: bool) -> int:
    """The bytes for weights and the device KV cache: --device-memory as given (bytes), or within it all
    this process allocates (--cap-device-memory), or the device's free memory less a reserve; a share
    (25%) is resolved later, from the dense and expert bytes. `spec`: the rank's part (rank 0's whole)."""
    log = structlog.get_logger()
    budget, reserve = default_budget(device, spec, config.max_tokens_per_handoff, itemsize, head=head)
    if isinstance(config.device_memory, int) and config.cap_device_memory:  # the whole process within it
        kept = capped_reserve(spec, config.max_tokens_per_handoff, itemsize, head)
        budget = cap_device_memory(device, config.device_memory, kept)
        log.info("device_memory_capped", total=config.device_memory, weights=budget, kept_back=kept)
    elif isinstance(config.device_memory, int):
        if device.type == "cuda" and config.device_memory > budget:
            log.warning("device_memory_above_free", asked=config.device_memory, free_less_reserve=budget)
        budget = config.device_memory
    elif reserve and config.device_memory is None:
        log.info("device_memory_default", budget=budget, kept_back=reserve)
    return budget


def build_worker(
    config: GpuExpertConfig,
    spec: ModelSpec,
    manifest: weight_store_pb2.GetManifestResponse,
    layout: ArenaLayout,
    shard: Shard,
    group: RankGroup | None,
) -> Worker:
    log = structlog.get_logger()
    device = rank_device(config.device, shard, config.tp_same_device)
    claim_device(device)  # again for a group's ranks (no-op); for one rank, its context on its own device
    mine = rank_spec(spec, shard)
    itemsize = DTYPES[DTYPE_FROM_PB[manifest.pages[0].dtype]].itemsize
    # rank 0 also holds the whole layer's q/k/v and attention result for the hand-off: the spec's
    budget = _budget(config, device, spec if shard.leads else mine, itemsize, shard.leads)
    arena = Segment.attach(manifest.region)
    closers: list[Callable[[bool], None]] = [lambda idle: arena.close()]
    pinned = pin_host_memory(arena.bytes(), device)
    if pinned:
        closers.append(lambda idle: unpin_host_memory(arena.bytes(), device) if idle else None)
    weights = weights_from_arena(arena.bytes(), layout, spec, device, experts_on_host=True, shard=shard)
    dtype = weights.layers[0].wo.dtype  # the dense weights': the experts' pages may be quantized
    # the HRM plans the dense stages on the model dtype's read rate (quant/dense.py's formats stay
    # unplanned): a sample of the weights as the arena holds them, one layer's once quantized (on a GPU
    # the originals are held until start ends)
    sample_layers = weights.layers[: 4 if config.quantize_dense == "none" else 1]
    dense = [t for layer in sample_layers for t in (layer.wqkv, layer.wo) if isinstance(t, torch.Tensor)]  # MLA: wo
    saved = quantize_dense(weights, config.quantize_dense)
    if saved:
        log.info("dense_quantized", format=config.quantize_dense, bytes_saved=saved)
    first = spec.experts_per_layer.index(spec.num_experts)  # the first sparse layer
    rank = shard.rank if shard.world > 1 else None
    expert_bytes = layout.expert_page_bytes(first, 0, rank)  # what one streamed expert moves (its scales included)
    if shard.world == 1:
        dense_bytes = layout.total_bytes - spec.total_experts * expert_bytes - saved
    else:  # the rank's slices of the dense weights (and the head on rank 0)
        dense_bytes = weights.nbytes() - spec.total_experts * expert_bytes
    if isinstance(config.device_memory, DeviceShare):  # the dense weights and that share of the experts
        budget = share_budget(config.device_memory, dense_bytes, expert_bytes, spec.total_experts)
        budget += config.device_kv_memory
    weight_budget = budget - config.device_kv_memory
    shape = (spec.num_layers, spec.num_experts, expert_bytes, dense_bytes, weight_budget)
    try:
        residency = plan_residency(*shape, dense_layers=spec.dense_layers)
    except DeviceBudgetError as exc:  # no room to stream: what does not fit can still run on the host
        residency = plan_residency(*shape, stream=False, dense_layers=spec.dense_layers)
        log.warning("no_streaming_buffer", reason=str(exc), experts_placement="host only")
    name = "gpu_expert" if shard.world == 1 else f"gpu_expert.rank{shard.rank}"
    timeline = TimelineRecorder(config.timeline, name, keep=config.timeline_keep if shard.leads else 0)
    closers.append(lambda idle: timeline.close())
    engine = make_copy_engine(device, timeline, config.link_bandwidth)
    pager = ExpertPager(weights, residency, device, timeline, lookahead=not config.no_overlap, engine=engine)
    closers.append(lambda idle: pager.close())
    kv = _device_kv_cache(mine, device, dtype, config.device_kv_memory, config.block_size)
    output, link = None, None
    if shard.leads:
        output = TensorChannel.create(
            segment_name(config.run_id, "gpu_expert", "qkv"),
            config.handoff_slots,
            handoff_slot_bytes(spec, config.max_tokens_per_handoff, "qkv", dtype),  # q/k/v as computed
        )
        link = HandoffLink(output, device)
        closers.append(lambda idle: link.close(unpin=idle))
    # as it computes: resident, else buffer slots, else on the host
    experts = list(pager.resident[first].values()) or pager.slots or list(weights.layers[first].experts)
    kernels.configure(config.expert_kernels)
    scheme = layout.expert_scheme()
    # each shape's kernel chosen now, on the weights as they compute (quantized pages; on a CPU the dense
    # GEMMs too, raced below kernels.DENSE_RACE_BELOW rows): a step never pays for a measurement
    kernels.warm_up([experts[0].w13, experts[0].w2, *step_dense_weights(weights)], dtype)
    if scheme.quantized:
        host = weights.layers[first].experts[0]  # computed where it lives, when experts are placed there
        if rows := host_warm_up_rows(config.experts_placement, residency, host.device != experts[0].device):
            kernels.warm_up([host.w13, host.w2], dtype, max_rows=rows)
    log.info("kernels_chosen", experts=scheme.key(), choices=kernels.chooser().report())
    measurements = cached_measurements(
        expert_side_key(device, dtype, mine, scheme),
        lambda: measure_expert_side(
            experts, str(device), budget, dtype, dense, scheme, config.recalibrate, config.profile_cache
        ),
        refresh=config.recalibrate,
        cache_dir=config.profile_cache,
    )
    if config.link_bandwidth is not None:  # the simulated link is the link the planner must see (not cached)
        measurements = simulated_link(measurements, config.link_bandwidth)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the calibration buffers' blocks go back to the device for activations
    runner = ExpertRunner(
        spec,
        weights,
        device,
        link,
        pager,
        kv,
        residency_interval=config.residency_interval,
        timeline=timeline,
        overlap=not config.no_overlap,
        count_syncs=config.count_syncs,
        group=group,  # the shard is the group's (one rank alone: SOLO)
        max_group_tokens=config.max_tokens_per_handoff,  # what default_budget kept activations back for
        mask_timeout=config.grammar_mask_timeout,
    )
    log.info(
        "residency",
        resident_experts=sum(len(r) for r in residency.resident),
        of=spec.total_experts,
        ring_slots=residency.ring_slots,
        double_buffered=residency.double_buffered,
        device_kv_blocks=kv.allocator.num_blocks if kv is not None else 0,
        device_bytes=residency.device_bytes,
        budget=budget,
        expert_slice_bytes=expert_bytes,
    )
    weight_bytes = layout.total_bytes - saved if shard.world == 1 else dense_bytes + spec.total_experts * expert_bytes
    return Worker(runner, device, budget, measurements, residency, weight_bytes, output, closers, timeline)
