"""The orchestrator's view of the worker services: wiring their channels and running steps."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog
from grpc_health.v1 import health_pb2

from moe_lightning.api.common.v1 import common_pb2
from moe_lightning.api.cpu_attention.v1 import cpu_attention_pb2, cpu_attention_pb2_grpc
from moe_lightning.api.gpu_expert.v1 import gpu_expert_pb2, gpu_expert_pb2_grpc
from moe_lightning.hrm.roofs import Measurements
from moe_lightning.kv_layout import KVLayout
from moe_lightning.placement import Side
from moe_lightning.quant.scheme import QuantScheme
from moe_lightning.service.convert import (
    DTYPE_FROM_PB,
    layout_from_pb,
    measurements_from_pb,
    step_output_from_pb,
    step_plan_to_pb,
    timeline_from_pb,
)
from moe_lightning.service.errors import UnavailableError
from moe_lightning.service.limits import DEFAULT_MAX_TOKENS
from moe_lightning.service.names import CPU_ATTENTION, GPU_EXPERT, WEIGHT_STORE
from moe_lightning.service.upstream import fetch_manifest, health_status, open_channel, wait_serving
from moe_lightning.spec import ModelSpec
from moe_lightning.step_protocol import StepOutput, StepPlan
from moe_lightning.timeline import Event
from orchestrator.step_faults import worker_error


@dataclass(frozen=True, slots=True)
class KVCapacity:
    """One KV cache as the scheduler admits against it."""

    blocks: int
    block_size: int
    dtype: str
    layout: KVLayout = None  # type: ignore[assignment]  # how sequences take its blocks; None: one layer group

    def __post_init__(self) -> None:
        if self.layout is None:  # (a block size of 0: no such cache, as the device's when it has none)
            object.__setattr__(self, "layout", KVLayout(max(1, self.block_size)))

    @property
    def tokens(self) -> int:
        """Tokens it holds for certain: sliding-window layers freeing blocks may let it hold more."""
        return self.layout.tokens_in(self.blocks)


@dataclass(slots=True)
class Capacity:
    kv_blocks: int
    block_size: int
    device: str
    weight_dtype: str  # of the arena (what the device computes in)
    expert_measurements: Measurements
    attention_measurements: Measurements
    device_kv_blocks: int = 0  # gpu_expert's own KV cache (attention placed on the device)
    device_kv_block_size: int = 0
    resident_experts: int = 0  # (layer, expert) pages gpu_expert keeps on the device
    expert_ring_slots: int = 0  # its buffer slots for streaming the rest (0: host placement only)
    max_handoff_tokens: int = DEFAULT_MAX_TOKENS  # the largest micro-batch both workers' channels carry
    kv_dtype: str = "float32"  # what cpu_attention's KV cache stores (its --kv-dtype)
    expert_scheme: QuantScheme = field(default_factory=QuantScheme)  # the arena's expert pages
    ranks: int = 1  # gpu_expert's tensor-parallel ranks: the HRM plans for that many devices
    spec: ModelSpec | None = None  # the model: its layers' windows lay out both KV caches (kv_layout.py)

    def placements(self, spec: ModelSpec) -> tuple[tuple[Side, ...], tuple[Side, ...]]:
        """(attention, experts) sides the running services support."""
        attention = (Side.HOST, Side.DEVICE) if self.device_kv_blocks else (Side.HOST,)
        if self.resident_experts >= spec.total_experts:
            return attention, (Side.DEVICE,)  # everything is on the device: nothing to place
        return attention, ((Side.DEVICE, Side.HOST) if self.expert_ring_slots else (Side.HOST,))

    def kv_cache(self, attention: Side) -> KVCapacity:
        """The KV cache attention reads where it is placed: gpu_expert's own (it stores the weights'
        dtype) or cpu_attention's (its --kv-dtype)."""
        if attention is Side.DEVICE:
            blocks, block_size, dtype = self.device_kv_blocks, self.device_kv_block_size, self.weight_dtype
        else:
            blocks, block_size, dtype = self.kv_blocks, self.block_size, self.kv_dtype
        layout = KVLayout.of(self.spec, block_size) if self.spec is not None and block_size else None
        return KVCapacity(blocks, block_size, dtype, layout)


class Backend:
    def __init__(self, weight_store: str, gpu_expert: str, cpu_attention: str, step_timeout: float = 300.0) -> None:
        self.addresses = {"weight_store": weight_store, "gpu_expert": gpu_expert, "cpu_attention": cpu_attention}
        self.step_timeout = step_timeout
        self.log = structlog.get_logger()
        self.spec: ModelSpec | None = None
        self.model_path = ""
        self._gpu: gpu_expert_pb2_grpc.GpuExpertStub | None = None
        self._cpu: cpu_attention_pb2_grpc.CpuAttentionStub | None = None
        self._channels: list[grpc.Channel] = []

    def connect(self, timeout: float = 600.0, stop: object | None = None) -> Capacity:
        """Waits for the three services, then tells each where the other's channel is. Connecting
        starts a new session on both workers (they drop every cached sequence), so it is also how
        the stack recovers after one of them restarted."""
        self.close()
        self.spec, manifest = fetch_manifest(self.addresses["weight_store"], timeout, stop)  # type: ignore[arg-type]
        self.model_path = manifest.model.model_path
        gpu_ch = wait_serving(self.addresses["gpu_expert"], GPU_EXPERT, timeout, stop)  # type: ignore[arg-type]
        cpu_ch = wait_serving(self.addresses["cpu_attention"], CPU_ATTENTION, timeout, stop)  # type: ignore[arg-type]
        self._channels = [gpu_ch, cpu_ch, open_channel(self.addresses["weight_store"])]
        self._gpu = gpu_expert_pb2_grpc.GpuExpertStub(gpu_ch)
        self._cpu = cpu_attention_pb2_grpc.CpuAttentionStub(cpu_ch)
        gpu = self._gpu.Describe(gpu_expert_pb2.DescribeRequest(), timeout=30)
        cpu = self._cpu.Describe(cpu_attention_pb2.DescribeRequest(), timeout=30)
        # gpu_expert first: its Connect waits for a step still running for a dead orchestrator, which
        # needs cpu_attention to still answer the old session
        session = secrets.randbits(63)
        self._gpu.Connect(gpu_expert_pb2.ConnectRequest(input_channel=cpu.output_channel, session=session), timeout=120)
        self._cpu.Connect(
            cpu_attention_pb2.ConnectRequest(input_channel=gpu.output_channel, session=session), timeout=30
        )
        self.log.info("backend_wired", qkv=gpu.output_channel, attn=cpu.output_channel, kv_blocks=cpu.num_blocks)
        dtype = DTYPE_FROM_PB[manifest.pages[0].dtype] if manifest.pages else self.spec.dtype
        return Capacity(
            cpu.num_blocks,
            cpu.block_size,
            gpu.device,
            dtype,
            measurements_from_pb(gpu.measurements),
            measurements_from_pb(cpu.measurements),
            gpu.device_kv_blocks,
            gpu.device_kv_block_size,
            gpu.resident_experts,
            gpu.expert_ring_slots,
            min(gpu.max_handoff_tokens or DEFAULT_MAX_TOKENS, cpu.max_handoff_tokens or DEFAULT_MAX_TOKENS),
            kv_dtype=DTYPE_FROM_PB.get(cpu.kv_dtype, "float32"),  # unset: a cpu_attention that only kept fp32
            expert_scheme=layout_from_pb(list(manifest.pages), manifest.region_bytes).expert_scheme(),
            ranks=max(1, gpu.tensor_parallel_ranks),  # unset: a gpu_expert of one device
            spec=self.spec,
        )

    def step(self, plan: StepPlan, fill_masks: Callable[[], dict[int, bytes]] | None = None) -> StepOutput:
        """Runs one step. `fill_masks` (which must not raise): the masks of the plan's `mask_follows` rows,
        computed here while the step runs and sent after it; should they not arrive, gpu_expert fails
        those rows alone when its --grammar-mask-timeout passes."""
        assert self._gpu is not None, "connect() first"
        try:
            call = self._gpu.Step.future(step_plan_to_pb(plan), timeout=self.step_timeout)
            if fill_masks is not None:
                self._send_masks(plan.step_id, fill_masks())
            answer = call.result()
        except grpc.RpcError as exc:  # what the requests are told, and whether the worker is lost
            raise worker_error(plan, exc) from None
        return step_output_from_pb(answer)

    def _send_masks(self, step_id: int, masks: dict[int, bytes]) -> None:
        assert self._gpu is not None
        pb = [gpu_expert_pb2.StepMask(seq_id=seq, token_mask=mask) for seq, mask in masks.items()]
        try:
            self._gpu.SetStepMasks(gpu_expert_pb2.SetStepMasksRequest(step_id=step_id, masks=pb), timeout=30)
        except grpc.RpcError as exc:  # the step's own answer tells what happened: its masks' rows time out
            self.log.warning("step_masks_not_sent", step_id=step_id, error=str(exc))

    def timeline(self, steps: int, timeout: float = 10.0) -> list[Event]:
        """The spans of the last `steps` steps gpu_expert ran, with cpu_attention's over the same time
        (both keep their recent spans in memory: --timeline-keep); [] before any step."""
        gpu, cpu = self._gpu, self._cpu
        if gpu is None or cpu is None:
            raise UnavailableError("the orchestrator is not connected to its workers")
        last = gpu_expert_pb2.GetTimelineRequest(query=common_pb2.TimelineQuery(steps=steps))
        device = timeline_from_pb(gpu.GetTimeline(last, timeout=timeout).spans)
        if not device:
            return []
        window = common_pb2.TimelineQuery(start_ns=device[0].start_ns, end_ns=max(e.end_ns for e in device))
        request = cpu_attention_pb2.GetTimelineRequest(query=window)
        host = timeline_from_pb(cpu.GetTimeline(request, timeout=timeout).spans)
        return sorted(device + host, key=lambda e: e.start_ns)

    def unhealthy(self, timeout: float = 1.0) -> list[str]:
        """The services that do not answer SERVING right now."""
        if not self._channels:
            return list(self.addresses)
        names = ("gpu_expert", "cpu_attention", "weight_store")
        services = (GPU_EXPERT, CPU_ATTENTION, WEIGHT_STORE)
        return [
            name
            for name, ch, svc in zip(names, self._channels, services, strict=True)
            if health_status(ch, svc, timeout) != health_pb2.HealthCheckResponse.SERVING
        ]

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
        self._channels = []
