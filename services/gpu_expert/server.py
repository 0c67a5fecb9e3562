"""gpu_expert: owns the device; maps the weight arena; runs pre-attention, post-attention (router
and experts) and the head for each step the orchestrator sends; returns the sampled tokens."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import grpc
import structlog
import torch
from prometheus_client import Counter, Gauge

from moe_lightning.api.gpu_expert.v1 import gpu_expert_pb2, gpu_expert_pb2_grpc
from moe_lightning.config.checks import check_device_flags, check_splittable
from moe_lightning.config.flag import EnvDefaultsParser
from moe_lightning.config.gpu_expert import GpuExpertConfig
from moe_lightning.config.service import internal_address
from moe_lightning.service.convert import (
    layout_from_pb,
    measurements_to_pb,
    step_output_to_pb,
    step_plan_from_pb,
    timeline_to_pb,
)
from moe_lightning.service.errors import NotReadyError
from moe_lightning.service.main_thread import MainThreadWork
from moe_lightning.service.names import GPU_EXPERT
from moe_lightning.service.runtime import ServiceRuntime, serve
from moe_lightning.service.upstream import fetch_manifest
from moe_lightning.tensor_parallel import Shard
from services.gpu_expert.follower import CONNECT, follower_main, rank_threads
from services.gpu_expert.leader import GroupLeader
from services.gpu_expert.rank_builder import Worker, build_worker, claim_device, rank_device
from services.gpu_expert.ranks import Command, RankGroup, RankGroupError
from services.gpu_expert.runner import ExpertRunner

STEP_EXIT_WAIT = 10.0  # seconds cleanup waits for a running step
DEVICE_BYTES = Gauge("moe_lightning_device_weight_bytes", "Weight bytes held on the device")
DEVICE_BUDGET = Gauge("moe_lightning_device_memory_budget_bytes", "--device-memory")
RESIDENT = Gauge("moe_lightning_resident_experts", "Expert pages kept on the device (of layers x experts)")
BUFFER_SLOTS = Gauge("moe_lightning_expert_buffer_slots", "Buffer slots (one expert each) for streamed experts")
RANK_STREAMED = Counter(
    "moe_lightning_rank_expert_bytes_streamed_total", "Tensor-parallel ranks: expert slice bytes streamed", ["rank"]
)
RANK_COLLECTIVES = Counter(
    "moe_lightning_rank_collective_seconds_total", "Tensor-parallel ranks: time in gathers and all-reduces", ["rank"]
)
LINK_ROOF = Gauge(
    "moe_lightning_link_bandwidth_bytes_per_second",
    "The host-device link's calibrated roof (rank 0's; each rank has its own link)",
    ["direction"],
)


class GpuExpertServicer(gpu_expert_pb2_grpc.GpuExpertServicer):
    def __init__(self, max_handoff_tokens: int) -> None:
        self._worker: Worker | None = None
        self.group: RankGroup | None = None  # tensor-parallel ranks: this is rank 0, which leads
        self.max_handoff_tokens = max_handoff_tokens
        self.step_lock = threading.Lock()  # one step at a time: the channels carry one step's hand-offs
        self.failed = False  # the rank group broke: exit non-zero so that the group restarts
        self.on_group_failure: Callable[[str], None] | None = None  # ends the group (rank 0's leader)
        self.idle: bool | None = None  # at shutdown: whether the step lock was had (see _idle)
        self.main_thread: MainThreadWork | None = None  # where steps run once serving (main_thread.py)

    def ready(self, worker: Worker, group: RankGroup | None) -> None:
        """Weights are mapped and calibrated: steps reach the worker's runner from now on."""
        self.group = group
        self._worker = worker  # last: a call that finds the worker finds the rest set

    @property
    def worker(self) -> Worker:
        if self._worker is None:
            raise NotReadyError("gpu_expert is still mapping weights; retry when health is SERVING")
        return self._worker

    @property
    def runner(self) -> ExpertRunner:
        return self.worker.runner

    def group_failed(self, reason: str, runtime: ServiceRuntime) -> None:
        """A rank died or a collective failed: NOT_SERVING, and the process exits (non-zero) so that
        it is restarted with a new group."""
        self.failed = True
        runtime.set_serving(False)
        threading.Thread(target=runtime.stop, name="tp-group-failed", daemon=True).start()

    def Describe(
        self, request: gpu_expert_pb2.DescribeRequest, context: grpc.ServicerContext
    ) -> gpu_expert_pb2.DescribeResponse:
        w = self.worker
        kv = w.runner.kv
        assert w.output is not None
        return gpu_expert_pb2.DescribeResponse(
            device=str(w.device),
            weight_bytes=w.weight_bytes,
            device_memory_bytes=w.budget,
            output_channel=w.output.name,
            measurements=measurements_to_pb(w.measurements),
            device_kv_blocks=kv.allocator.num_blocks if kv is not None else 0,
            device_kv_block_size=kv.block_size if kv is not None else 0,
            resident_experts=sum(len(r) for r in w.residency.resident),
            expert_ring_slots=w.residency.ring_slots,
            max_handoff_tokens=self.max_handoff_tokens,
            tensor_parallel_ranks=self.group.shard.world if self.group is not None else 1,
        )

    def Connect(
        self, request: gpu_expert_pb2.ConnectRequest, context: grpc.ServicerContext
    ) -> gpu_expert_pb2.ConnectResponse:
        with self.step_lock:
            self.runner.connect(request.input_channel, request.session)
            if self.group is not None:
                assert self.runner.link is not None
                self._to_ranks(Command.CONNECT, CONNECT.pack(request.session, *self.runner.link.slots))
        return gpu_expert_pb2.ConnectResponse()

    def Step(self, request: gpu_expert_pb2.StepRequest, context: grpc.ServicerContext) -> gpu_expert_pb2.StepResponse:
        t0 = time.perf_counter_ns()
        plan = step_plan_from_pb(request)
        pager = self.runner.pager
        with self.step_lock:
            streamed = pager.bytes_streamed if pager is not None else 0
            if self.group is not None:
                self._to_ranks(Command.STEP, request.SerializeToString())
            try:
                runner = self.runner
                out = self.main_thread.run(lambda: runner.step(plan)) if self.main_thread else runner.step(plan)
            except RankGroupError as exc:  # the ranks are out of step: the group ends here, lock held
                self._group_broke(str(exc))
                raise
            if self.group is None and pager is not None:  # one device is rank 0 of one: the same panels hold
                RANK_STREAMED.labels("0").inc(pager.bytes_streamed - streamed)
        for r in out.ranks:
            RANK_STREAMED.labels(str(r.rank)).inc(r.bytes_streamed)
            RANK_COLLECTIVES.labels(str(r.rank)).inc(r.collectives / 1e9)
        out.timings.handler = time.perf_counter_ns() - t0  # the step plus its protobuf conversion
        return step_output_to_pb(out)

    def SetStepMasks(
        self, request: gpu_expert_pb2.SetStepMasksRequest, context: grpc.ServicerContext
    ) -> gpu_expert_pb2.SetStepMasksResponse:
        # no step lock: its step holds it, and its head waits for these (step_masks.py)
        self.runner.masks.deliver(request.step_id, {m.seq_id: m.token_mask for m in request.masks})
        return gpu_expert_pb2.SetStepMasksResponse()

    def GetTimeline(
        self, request: gpu_expert_pb2.GetTimelineRequest, context: grpc.ServicerContext
    ) -> gpu_expert_pb2.GetTimelineResponse:
        q = request.query  # no step lock: the recorder has its own, and a long step must not hold this up
        events = self.worker.timeline.recent(q.steps, q.start_ns, q.end_ns)
        return gpu_expert_pb2.GetTimelineResponse(spans=timeline_to_pb(events))

    def _to_ranks(self, command: Command, payload: bytes) -> None:
        """With the step lock held: a command to the other ranks (a failed group refuses it)."""
        assert self.group is not None
        if self.failed:
            raise RankGroupError("the tensor-parallel group failed and is restarting")
        try:
            self.group.send_command(command, payload)
        except RankGroupError as exc:
            self._group_broke(str(exc))
            raise

    def _group_broke(self, reason: str) -> None:
        self.failed = True
        if self.on_group_failure is not None:
            self.on_group_failure(reason)


def build_parser() -> EnvDefaultsParser:
    p = EnvDefaultsParser(prog="moe-lightning-gpu-expert", description=__doc__)
    GpuExpertConfig.add_cli_args(p, defaults={"address": internal_address("gpu_expert")})
    return p


def _start(
    config: GpuExpertConfig, argv: Sequence[str], servicer: GpuExpertServicer, runtime: ServiceRuntime
) -> dict[str, Any]:
    """Maps the arena, plans what stays on the device, calibrates (with N ranks: starts the others and
    forms the group first); the fields of the `serving` line."""
    log = runtime.log
    spec, manifest = fetch_manifest(config.weight_store, stop=runtime)
    layout = layout_from_pb(list(manifest.pages), manifest.region_bytes)
    shard = Shard(0, config.gpus)
    check_splittable(spec, shard.world, layout.expert_scheme())
    group = None
    check_device_flags(config.device, config.link_bandwidth, config.tp_same_device, config.tp_backend)
    if shard.world > 1:
        if layout.ranks() != shard.world:
            raise ValueError(
                f"the weight store laid the experts out for {layout.ranks()} rank(s), not {shard.world}: "
                f"start it with --tensor-parallel {shard.world}"
            )
        leader = GroupLeader(shard.world, argv)
        runtime.on_shutdown(lambda: leader.stop(idle=_idle(servicer)))
        device = rank_device(config.device, shard, config.tp_same_device)
        claim_device(device)
        timeouts = (config.tp_timeout, leader.rendezvous, config.tp_startup_timeout)
        leader.group = group = RankGroup(spec, shard, device, config.tp_backend, *timeouts)
    worker = build_worker(config, spec, manifest, layout, shard, group)
    runtime.on_shutdown(lambda: worker.close(idle=_idle(servicer)))
    if group is not None:
        group.wait_all_ready(config.tp_startup_timeout)
        servicer.on_group_failure = lambda reason: leader.fail(reason, lambda r: servicer.group_failed(r, runtime))
        leader.watch(servicer.step_lock, servicer.on_group_failure)
    m = worker.measurements
    log.info("calibrated", **{k: round(v) if isinstance(v, float) else v for k, v in asdict(m).items()})
    LINK_ROOF.labels("h2d").set(m.h2d_bandwidth)
    LINK_ROOF.labels("d2h").set(m.d2h_bandwidth)
    RANK_STREAMED.labels("0")  # exported from the start (at 0), so the panels have a series before any copy
    RANK_COLLECTIVES.labels("0")
    RESIDENT.set(sum(len(r) for r in worker.residency.resident))
    BUFFER_SLOTS.set(worker.residency.ring_slots)
    servicer.main_thread = runtime.main_thread
    servicer.ready(worker, group)
    DEVICE_BYTES.set(worker.residency.device_bytes)
    DEVICE_BUDGET.set(worker.budget)
    assert worker.output is not None
    fields = {"device": str(worker.device), "weight_bytes": worker.weight_bytes, "output_channel": worker.output.name}
    return fields | ({"tensor_parallel_ranks": shard.world} if shard.world > 1 else {})


def _idle(servicer: GpuExpertServicer) -> bool:
    """No step runs (waits for one a while): memory a copy may use can be unpinned, the others told to stop.
    A step may still run past the grace period: unregistering memory a copy is using would fault it,
    so then the pinning is left to the process's exit."""
    if servicer.idle is None:
        servicer.idle = servicer.step_lock.acquire(timeout=STEP_EXIT_WAIT)
        if not servicer.idle:
            structlog.get_logger().warning("step_still_running_at_exit", action="memory left pinned until exit")
    return servicer.idle


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    config = GpuExpertConfig.from_cli_args(build_parser().parse_args(argv))
    if config.device is None:
        config.device = "cuda" if torch.cuda.is_available() else "cpu"
    if config.tp_rank > 0:
        return follower_main(config)
    config.threads = rank_threads(config, config.gpus)
    servicer = GpuExpertServicer(config.max_tokens_per_handoff)
    code = serve(
        config,
        "gpu_expert",
        GPU_EXPERT,
        gpu_expert_pb2_grpc.add_GpuExpertServicer_to_server,
        servicer,
        lambda runtime: _start(config, argv, servicer, runtime),
    )
    return 1 if servicer.failed else code


if __name__ == "__main__":
    sys.exit(main())
