"""cpu_attention: owns the paged KV cache in host shared memory and runs attention for ragged
micro-batches handed over by the expert service through shared memory."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import grpc
import structlog
import torch

from moe_lightning import kv_format
from moe_lightning import native as native_kernels
from moe_lightning.api.cpu_attention.v1 import cpu_attention_pb2, cpu_attention_pb2_grpc
from moe_lightning.config.cpu_attention import CpuAttentionConfig
from moe_lightning.config.flag import EnvDefaultsParser
from moe_lightning.config.host_memory import resolve_kv_cache_memory
from moe_lightning.config.service import internal_address
from moe_lightning.config.units import format_size
from moe_lightning.handoff import handoff_slot_bytes
from moe_lightning.hrm.calibrate import cached_measurements, measure_attention_side
from moe_lightning.hrm.roofs import Measurements
from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.kv_layout import KVLayout
from moe_lightning.native import decode_kernel
from moe_lightning.service.convert import DTYPE_TO_PB, measurements_to_pb, timeline_to_pb
from moe_lightning.service.errors import NotReadyError
from moe_lightning.service.names import CPU_ATTENTION
from moe_lightning.service.runtime import ServiceRuntime, serve
from moe_lightning.service.upstream import arena_dtype, arena_page_copies, fetch_manifest
from moe_lightning.stages.attention import attends_in_fp32
from moe_lightning.timeline import TimelineRecorder
from moe_lightning.torch_dtypes import DTYPES
from services.cpu_attention.worker import AttentionWorker

# --kv-dtype -> what the cache is built with: a float dtype, or a kv_format name (int8: values + scales)
KV_DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    kv_format.INT8: kv_format.INT8,
}


class CpuAttentionServicer(cpu_attention_pb2_grpc.CpuAttentionServicer):
    def __init__(self) -> None:
        self._worker: AttentionWorker | None = None
        self.measurements: Measurements | None = None
        self.max_handoff_tokens = 0

    def ready(self, worker: AttentionWorker, measurements: Measurements, max_handoff_tokens: int) -> None:
        """Start-up is done: calls reach `worker` from now on."""
        self.measurements = measurements
        self.max_handoff_tokens = max_handoff_tokens
        self._worker = worker  # last: a call that finds the worker finds the rest set

    @property
    def worker(self) -> AttentionWorker:
        if self._worker is None:
            raise NotReadyError("cpu_attention is still starting; retry when health is SERVING")
        return self._worker

    def Describe(
        self, request: cpu_attention_pb2.DescribeRequest, context: grpc.ServicerContext
    ) -> cpu_attention_pb2.DescribeResponse:
        cache = self.worker.cache
        return cpu_attention_pb2.DescribeResponse(
            num_blocks=cache.allocator.num_blocks,
            block_size=cache.block_size,
            free_blocks=cache.num_free_blocks,
            output_channel=self.worker.output.name,
            measurements=measurements_to_pb(self.measurements) if self.measurements else None,
            max_handoff_tokens=self.max_handoff_tokens,
            kv_dtype=DTYPE_TO_PB[cache.format],  # the format's name: int8 is DTYPE_INT8
        )

    def Connect(
        self, request: cpu_attention_pb2.ConnectRequest, context: grpc.ServicerContext
    ) -> cpu_attention_pb2.ConnectResponse:
        self.worker.connect(request.input_channel, request.session)
        return cpu_attention_pb2.ConnectResponse()

    def GetTimeline(
        self, request: cpu_attention_pb2.GetTimelineRequest, context: grpc.ServicerContext
    ) -> cpu_attention_pb2.GetTimelineResponse:
        q = request.query
        events = self.worker.timeline.recent(q.steps, q.start_ns, q.end_ns)
        return cpu_attention_pb2.GetTimelineResponse(spans=timeline_to_pb(events))


def build_parser() -> EnvDefaultsParser:
    p = EnvDefaultsParser(prog="moe-lightning-cpu-attention", description=__doc__)
    CpuAttentionConfig.add_cli_args(p, defaults={"address": internal_address("cpu_attention")})
    return p


def _start(config: CpuAttentionConfig, servicer: CpuAttentionServicer, runtime: ServiceRuntime) -> dict[str, Any]:
    """Sizes and maps the KV cache, calibrates, starts the attention loop; the fields of `serving`."""
    spec, manifest = fetch_manifest(config.weight_store, stop=runtime)  # the stack cannot start without a model
    kv_name = arena_dtype(spec, manifest) if config.kv_dtype == "auto" else config.kv_dtype
    kv_dtype = KV_DTYPES[kv_name]
    # auto: by the host's free memory, now, less the hand-off channels still to be made: this service's
    # attention outputs and gpu_expert's q/k/v, each `handoff_slots` slots of activations in the
    # weights' dtype (what gpu_expert computes in)
    tokens, act_dtype = config.max_tokens_per_handoff, DTYPES[arena_dtype(spec, manifest)]
    slot_bytes = {kind: handoff_slot_bytes(spec, tokens, kind, act_dtype) for kind in ("attn", "qkv")}
    channels = config.handoff_slots * sum(slot_bytes.values())
    budget = resolve_kv_cache_memory(config.kv_cache_memory, pending=channels)
    structlog.get_logger().info(
        "kv_cache_memory", bytes=budget.nbytes, size=format_size(budget.nbytes), chosen=budget.reason
    )
    num_blocks = PagedKVCache.blocks_in(budget.nbytes, spec, config.block_size, kv_dtype, "--kv-cache-memory")
    worker = AttentionWorker(
        spec,
        num_blocks,
        config.block_size,
        config.run_id,
        slot_bytes["attn"],
        slots=config.handoff_slots,
        timeline=TimelineRecorder(config.timeline, "cpu_attention", keep=config.timeline_keep),
        kv_dtype=kv_dtype,
        sinks=arena_page_copies(manifest, [f"layers.{i}.sinks" for i in range(spec.num_layers)])
        if spec.attention_sinks
        else None,
    )
    cache_dtype = kv_dtype if isinstance(kv_dtype, torch.dtype) else torch.int8  # a kv_format name: int8
    if not attends_in_fp32(act_dtype, cache_dtype, spec.attention_sinks, "cpu"):  # sdpa's 16-bit kernel
        native_kernels.not_needed(native_kernels.SOURCE.name, f"{act_dtype} over a {cache_dtype} cache: sdpa's kernel")
    native = decode_kernel()  # built now if it is not yet, and logged: which decode attention runs
    attention_kernel = f"native-{native.isa}" if native is not None else "pytorch"
    # the roofs are the kernel's that runs: a calibration of the other is not reused
    key = f"cpu_attention-{spec.num_heads}x{spec.num_kv_heads}x{spec.head_dim}-{kv_name}-{attention_kernel}"
    measurements = cached_measurements(
        key,
        lambda: measure_attention_side(spec, kv_dtype=kv_dtype),
        refresh=config.recalibrate,
        cache_dir=config.profile_cache,
    )
    servicer.ready(worker, measurements, config.max_tokens_per_handoff)
    runtime.on_shutdown(worker.stop)
    worker.start()
    return {
        "kv_cache_memory": budget.nbytes,
        "kv_blocks": num_blocks,
        "block_size": config.block_size,
        "kv_tokens": KVLayout.of(spec, config.block_size).tokens_in(num_blocks),
        "kv_dtype": kv_name,
        "decode_attention": attention_kernel,
        "output_channel": worker.output.name,
    }


def main(argv: Sequence[str] | None = None) -> int:
    config = CpuAttentionConfig.from_cli_args(build_parser().parse_args(argv))
    servicer = CpuAttentionServicer()
    return serve(
        config,
        "cpu_attention",
        CPU_ATTENTION,
        cpu_attention_pb2_grpc.add_CpuAttentionServicer_to_server,
        servicer,
        lambda runtime: _start(config, servicer, runtime),
    )


if __name__ == "__main__":
    sys.exit(main())
