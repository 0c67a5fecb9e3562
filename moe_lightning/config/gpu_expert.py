"""gpu_expert's config: its device and budget, the schedule, the kernels, and its tensor-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass

from moe_lightning.config import choices, flags
from moe_lightning.config.flag import REQUIRED, CliConfig, Flag, option
from moe_lightning.config.service import ServiceConfig, WorkerConfig
from moe_lightning.config.units import DeviceShare

NO_OVERLAP = Flag(
    "--no-overlap",
    "baseline schedule: copy each layer's experts when needed, one micro-batch at a time",
    action="store_true",
)
GRAMMAR_MASK_TIMEOUT = Flag(
    "--grammar-mask-timeout",
    "seconds the head waits for a step's grammar masks (the orchestrator fills them while the step's layers run) "
    "before it fails the step's structured-output requests",
    type=float,
)
TP_BACKEND = Flag(
    "--tp-backend",
    "the ranks' all-reduces: auto = NCCL on CUDA, gloo on CPU; gloo on CUDA runs several ranks on one GPU (a "
    "check; NCCL refuses that)",
    choices=choices.TP_BACKENDS,
)
TP_SAME_DEVICE = Flag(
    "--tp-same-device",
    "every rank on --device itself (with --tp-backend gloo): a check of several ranks on one GPU",
    action="store_true",
)
TP_TIMEOUT = Flag(
    "--tp-timeout", "seconds any collective may wait for the other ranks before the group counts as broken", type=float
)
TP_STARTUP_TIMEOUT = Flag("--tp-startup-timeout", "seconds the ranks may take to build their slices", type=float)
TP_RANK = Flag("--tp-rank", "this process's rank (set by rank 0 for the others)", type=int, hidden=True)
TP_RENDEZVOUS = Flag("--tp-rendezvous", "the group's rendezvous (set by rank 0 for the others)", hidden=True)


@dataclass(kw_only=True)
class TensorParallelConfig(CliConfig):
    """gpu_expert's ranks (docs/parallel.md)."""

    gpus: int = option(flags.GPUS, 1)
    tp_backend: str = option(TP_BACKEND, "auto")
    tp_same_device: bool = option(TP_SAME_DEVICE, False)
    tp_timeout: float = option(TP_TIMEOUT, 60.0)
    tp_startup_timeout: float = option(TP_STARTUP_TIMEOUT, 900.0)
    tp_rank: int = option(TP_RANK, 0)
    tp_rendezvous: str | None = option(TP_RENDEZVOUS)


@dataclass(kw_only=True)
class GpuExpertConfig(TensorParallelConfig, WorkerConfig, ServiceConfig):
    weight_store: str = option(flags.WEIGHT_STORE, REQUIRED)
    device: str | None = option(flags.DEVICE)  # None: cuda when a GPU is visible, else cpu (server.main resolves)
    device_memory: int | DeviceShare | None = option(flags.DEVICE_MEMORY)  # None: the free memory less a reserve
    cap_device_memory: bool = option(flags.CAP_DEVICE_MEMORY, False)
    device_kv_memory: int = option(flags.DEVICE_KV_MEMORY, 0)
    block_size: int = option(flags.BLOCK_SIZE, 16)
    no_overlap: bool = option(NO_OVERLAP, False)
    grammar_mask_timeout: float = option(GRAMMAR_MASK_TIMEOUT, 30.0)
    expert_kernels: str = option(flags.EXPERT_KERNELS, "fastest")
    quantize_dense: str = option(flags.QUANTIZE_DENSE, "none")
    # the orchestrator's, for what to warm up at start (rank_builder.py); each step's plan carries the one in force
    experts_placement: str = option(flags.EXPERTS_PLACEMENT, "auto")
    link_bandwidth: float | None = option(flags.LINK_BANDWIDTH)
    residency_interval: int = option(flags.RESIDENCY_INTERVAL, 256)
    count_syncs: bool = option(flags.COUNT_SYNCS, False)
