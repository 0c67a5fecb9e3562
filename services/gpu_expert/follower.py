"""A gpu_expert rank other than 0: started by rank 0 (leader.py), it joins the group, builds its
slice (rank_builder.py) and then runs what rank 0 sends: each step on its slice, a new session when rank
0 connects, a stop at shutdown. It has no gRPC server of its own: rank 0 speaks for the group and
reports each rank's share of a step (its bytes streamed, its time in collectives)."""

from __future__ import annotations

import os
import signal
import struct

import structlog
import torch

from moe_lightning.api.gpu_expert.v1 import gpu_expert_pb2
from moe_lightning.config.gpu_expert import GpuExpertConfig
from moe_lightning.service.convert import layout_from_pb, step_plan_from_pb
from moe_lightning.service.logs import configure_logging
from moe_lightning.service.upstream import fetch_manifest
from moe_lightning.tensor_parallel import Shard
from services.gpu_expert.rank_builder import build_worker, claim_device, rank_device
from services.gpu_expert.ranks import Command, RankGroup, RankGroupError

CONNECT = struct.Struct("<qqq")  # the CONNECT payload: session, rank 0's output and input channel slots


def rank_threads(config: GpuExpertConfig, world: int) -> int:
    """torch threads of one rank: --threads, or on a CPU device the cores shared out among the ranks."""
    if config.threads > 0 or world == 1:
        return config.threads
    if torch.device(config.device or "cpu").type != "cpu":
        return 0
    return max(1, len(os.sched_getaffinity(0)) // world)  # the cores this process may run on


def follower_main(config: GpuExpertConfig) -> int:
    shard = Shard(config.tp_rank, config.gpus)
    log = configure_logging(f"gpu_expert.rank{shard.rank}", config.log_level, config.log_json or None)
    structlog.contextvars.bind_contextvars(rank=shard.rank)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # rank 0 is gone or stops us: nothing to hand back
    if threads := rank_threads(config, shard.world):
        torch.set_num_threads(threads)
    spec, manifest = fetch_manifest(config.weight_store)
    layout = layout_from_pb(list(manifest.pages), manifest.region_bytes)
    device = rank_device(config.device, shard, config.tp_same_device)
    claim_device(device)
    try:
        group = RankGroup(
            spec, shard, device, config.tp_backend, config.tp_timeout, config.tp_rendezvous, config.tp_startup_timeout
        )
        worker = build_worker(config, spec, manifest, layout, shard, group)
        group.wait_all_ready(config.tp_startup_timeout)
    except RankGroupError as exc:
        log.error("startup_failed", error=str(exc))
        return 1
    log.info("rank_ready", device=str(device), weight_bytes=worker.weight_bytes, budget=worker.budget)
    runner = worker.runner
    try:
        while True:
            command, payload = group.receive_command()
            if command is Command.STOP:
                break
            if command is Command.CONNECT:
                _session, out_slots, in_slots = CONNECT.unpack(payload)
                runner.connect_rank((out_slots, in_slots))
            elif command is Command.STEP:
                try:
                    runner.step(step_plan_from_pb(gpu_expert_pb2.StepRequest.FromString(payload)))
                except RankGroupError:
                    raise
                except Exception as exc:  # refused before it ran, by every rank alike (ExpertRunner._step)
                    log.info("step_refused", error=str(exc))
    except RankGroupError as exc:
        log.error("tensor_parallel_group_failed", error=str(exc))
        worker.close(idle=True)
        os._exit(1)  # no teardown of a broken group (NCCL's may hang): rank 0 forms a new one
    worker.close(idle=True)
    group.close()
    return 0
