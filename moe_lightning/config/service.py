"""What every service process takes (ServiceConfig), and what the two workers share (WorkerConfig)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from moe_lightning.config import flags
from moe_lightning.config.flag import CliConfig, Flag, option
from moe_lightning.config.units import non_negative_int
from moe_lightning.service.limits import DEFAULT_MAX_TOKENS, DEFAULT_SLOTS

# a few decode steps of Mixtral 8x7B in 16 micro-batches (~2,000 spans each), ~5 MB of tuples
TIMELINE_KEEP = 1 << 15

INTERNAL_TOKEN = Flag(
    "--internal-token",
    "shared secret of the internal services: required from callers by the weight store, gpu_expert and "
    "cpu_attention (mandatory when they listen on TCP), sent by every service to the ones it calls; set it as "
    "MOE_LIGHTNING_INTERNAL_TOKEN, not on the command line, where ps shows it",
    secret=True,
)
METRICS_PORT = Flag("--metrics-port", "Prometheus HTTP port (0 = any free port)", type=int)
METRICS_HOST = Flag("--metrics-host", "Prometheus HTTP bind address", type=str)

MAX_TOKENS_PER_HANDOFF = Flag(
    "--max-tokens-per-handoff",
    "largest micro-batch (tokens) one hand-off carries; sizes the channel slots (the planner keeps micro-batches "
    "within the smaller of the two workers' values)",
    type=int,
)
HANDOFF_SLOTS = Flag(
    "--handoff-slots",
    "slots of this worker's outgoing hand-off channel: how many micro-batches attention may run ahead of the "
    "device (any number of micro-batches works with any number of slots)",
    type=int,
)
THREADS = Flag("--threads", "torch threads (0 = torch's default)", type=non_negative_int)
TIMELINE = Flag("--timeline", "append (step, layer, micro-batch) start/end times to this file", type=Path)
TIMELINE_KEEP_FLAG = Flag(
    "--timeline-keep",
    "(step, layer, micro-batch) spans kept in memory for the orchestrator's live pipeline picture (its "
    "/debug/timeline.png and /debug/trace.json); 0: none",
    type=int,
)
PROFILE_CACHE = Flag(
    "--profile-cache",
    "directory of measured roofs reused across starts (default: ~/.cache/moe-lightning/profiles)",
    type=Path,
)
RECALIBRATE = Flag(
    "--recalibrate",
    "re-measure this service's roofs at warm-up instead of reusing this machine's cache",
    action="store_true",
)


def default_socket_dir() -> Path:
    """Where an internal service started by hand listens: $XDG_RUNTIME_DIR/moe-lightning (per user,
    mode 0700 by the system), else a per-user directory under the temp dir. Created 0700 and checked
    for owner and mode when a service binds there (auth.ensure_private_dir)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        return Path(runtime) / "moe-lightning"
    return Path(tempfile.gettempdir()) / f"moe-lightning-uid{os.getuid()}"


def internal_address(service: str) -> str:
    """The default listen address of an internal service: a unix socket only this user can reach
    (on TCP any local user could call Connect or Step)."""
    return f"unix://{default_socket_dir() / f'{service}.sock'}"


@dataclass(kw_only=True)
class ServiceConfig(CliConfig):
    """Every gRPC service's listen address, secret, metrics, segment names and logs."""

    address: str = option(flags.ADDRESS, "")  # "": the service's own default (a unix socket, or the API's port)
    internal_token: str | None = option(INTERNAL_TOKEN)
    metrics_port: int = option(METRICS_PORT, 0)
    metrics_host: str = option(METRICS_HOST, "127.0.0.1")
    run_id: str = option(flags.RUN_ID, "default")
    log_level: str = option(flags.LOG_LEVEL, "info")
    log_json: bool = option(flags.LOG_JSON, False)


@dataclass(kw_only=True)
class WorkerConfig(CliConfig):
    """What gpu_expert and cpu_attention share: their hand-off channels, threads, timelines and roofs."""

    max_tokens_per_handoff: int = option(MAX_TOKENS_PER_HANDOFF, DEFAULT_MAX_TOKENS)
    handoff_slots: int = option(HANDOFF_SLOTS, DEFAULT_SLOTS)
    threads: int = option(THREADS, 0)
    timeline: Path | None = option(TIMELINE)
    timeline_keep: int = option(TIMELINE_KEEP_FLAG, TIMELINE_KEEP)
    profile_cache: Path | None = option(PROFILE_CACHE)
    recalibrate: bool = option(RECALIBRATE, False)
