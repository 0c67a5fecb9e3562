"""Command-line flags that can also be set by environment variable (MOE_LIGHTNING_<FLAG>)."""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path
from typing import Any

ENV_PREFIX = "MOE_LIGHTNING_"
# a few decode steps of Mixtral 8x7B in 16 micro-batches (~2,000 spans each), ~5 MB of tuples
TIMELINE_KEEP = 1 << 15
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}


def format_size(n: float) -> str:
    """Bytes for people: 1.50 GiB, 300.0 MiB, 12.0 KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def parse_size(text: str) -> int:
    """'4GiB', '512MB', '1.5G', '1000' -> bytes."""
    m = _SIZE.match(str(text))
    if m is None or m[2].lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 4GiB, 512MB or 1000000, got {text!r}")
    return int(float(m[1]) * _UNITS[m[2].lower()])


def parse_rate(text: str) -> float:
    """'2GB/s', '500MiB/s', '1.5e9', '2G' -> bytes per second (positive)."""
    raw = str(text).strip()
    body = raw[:-2] if raw.lower().endswith("/s") else raw
    try:
        rate = float(body)  # plain and scientific notation (1.5e9)
    except ValueError:
        try:
            rate = float(parse_size(body))
        except argparse.ArgumentTypeError:
            rate = -1.0
    if not rate > 0 or rate == float("inf"):
        raise argparse.ArgumentTypeError(
            f"expected a positive rate in bytes per second like 2GB/s, 500MiB/s or 1.5e9, got {text!r}"
        )
    return rate


def format_rate(rate: float) -> str:
    """Bytes per second for people: 1.50 GB/s, 300.0 MB/s (decimal units, as links are quoted)."""
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if rate >= scale:
            return f"{rate / scale:.2f} {unit}"
    return f"{rate:.0f} B/s"


def add_link_flags(parser: argparse.ArgumentParser) -> None:
    """The simulated host-device link of a CPU device (gpu_expert's, `up`'s and `bench`'s flag;
    docs/cgopipe-and-benchmarks.md, "The link on the CPU")."""
    parser.add_argument(
        "--link-bandwidth",
        type=parse_rate,
        default=None,
        metavar="BYTES_PER_S",
        help="with --device cpu: stream expert pages no faster than this (e.g. 2GB/s), as a PCIe link would; the "
        "copy thread sleeps out each page's time, and the HRM plans with this figure as its host-to-device "
        "bandwidth. Simulates the link only: device and host compute still share the CPU's cores",
    )


def link_flag_error(device: str, link_bandwidth: float | None) -> str | None:
    """Why --link-bandwidth cannot be used with `device` (None: it can)."""
    if link_bandwidth is None or device.split(":")[0] == "cpu":
        return None
    return (
        f"--link-bandwidth simulates a host-device link for --device cpu; --device {device} copies over its real "
        "link, which is not capped: leave --link-bandwidth out"
    )


class EnvDefaultsParser(argparse.ArgumentParser):
    """An ArgumentParser whose options take their default from MOE_LIGHTNING_<FLAG> when set (an empty
    value counts as unset, as compose's `${VAR:-}` passes one)."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:  # type: ignore[override]
        action = super().add_argument(*args, **kwargs)
        if action.option_strings and action.dest != "help":
            env = ENV_PREFIX + action.dest.upper()
            if os.environ.get(env):
                raw = os.environ[env]
                if isinstance(action, argparse._StoreTrueAction):
                    action.default = raw.lower() in ("1", "true", "yes", "on")
                elif isinstance(action, argparse._AppendAction):
                    action.default = [action.type(v) if action.type else v for v in raw.split(",")]
                else:
                    action.default = action.type(raw) if action.type else raw
                action.required = False
            if action.help and action.help is not argparse.SUPPRESS:
                action.help += f" [env {env}]"
        return action


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


def add_service_flags(parser: argparse.ArgumentParser, default_address: str) -> None:
    """Flags every service process takes."""
    parser.add_argument(
        "--address",
        default=default_address,
        help="gRPC listen address: unix:///path.sock or host:port (an internal service on TCP needs --internal-token)",
    )
    parser.add_argument(
        "--internal-token",
        default=None,
        help="shared secret of the internal services: required from callers by the weight store, gpu_expert and "
        "cpu_attention (mandatory when they listen on TCP), sent by every service to the ones it calls; "
        "set it by environment, not on the command line, where ps shows it",
    )
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus HTTP port (0 = any free port)")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="Prometheus HTTP bind address")
    parser.add_argument(
        "--run-id",
        default="default",
        help="names this stack's shared-memory segments, so two stacks on one box do not collide",
    )
    parser.add_argument("--log-level", default="info", help="debug, info, warning or error")
    parser.add_argument("--log-json", action="store_true", help="JSON logs even on a terminal")


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    """Flags the two worker services (gpu_expert, cpu_attention) share."""
    # here, not at the top: handoff imports torch, which the HTTP gateway (a flags user) never needs
    from moe_lightning.handoff import DEFAULT_MAX_TOKENS, DEFAULT_SLOTS

    parser.add_argument(
        "--max-tokens-per-handoff",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="largest micro-batch (tokens) one hand-off carries; sizes the channel slots (the planner "
        "keeps micro-batches within the smaller of the two workers' values)",
    )
    parser.add_argument(
        "--handoff-slots",
        type=int,
        default=DEFAULT_SLOTS,
        help="slots of this worker's outgoing hand-off channel: how many micro-batches attention may run "
        "ahead of the device (any number of micro-batches works with any number of slots)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument(
        "--timeline", default=None, help="append (step, layer, micro-batch) start/end times to this file"
    )
    parser.add_argument(
        "--timeline-keep",
        type=int,
        default=TIMELINE_KEEP,
        help="(step, layer, micro-batch) spans kept in memory for the orchestrator's live pipeline picture "
        "(its /debug/timeline.png and /debug/trace.json); 0: none",
    )
    parser.add_argument(
        "--profile-cache",
        type=Path,
        default=None,
        help="directory of measured roofs reused across starts (default: ~/.cache/moe-lightning/profiles)",
    )
    parser.add_argument(
        "--recalibrate",
        action="store_true",
        help="re-measure this service's roofs at warm-up instead of reusing this machine's cache",
    )


def add_batch_flags(parser: argparse.ArgumentParser) -> None:
    """Batch and micro-batch sizes; unset, the orchestrator's HRM policy decides."""
    parser.add_argument(
        "--max-batch-size", type=int, default=None, help="requests decoded together (default: the HRM's policy)"
    )
    parser.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="sequences per micro-batch (default: the HRM's policy; 0 = whole batch)",
    )


def add_quantize_flags(parser: argparse.ArgumentParser, with_auto: bool = True) -> None:
    """The expert format (docs/quantization.md): the weight store's, `up`'s, `bench`'s and `plan`'s."""
    choices = ["auto", "none", "int8", "int4"] if with_auto else ["none", "int8", "int4"]
    parser.add_argument(
        "--quantize",
        default=choices[0],
        choices=choices,
        help="format of the expert pages: int8 (per-channel) or int4 (group-wise), quantized at load by rounding "
        "to nearest; none keeps the model's dtype"
        + ("; auto: the checkpoint's own (int4 for a GPTQ checkpoint, else none)" if with_auto else ""),
    )
    parser.add_argument(
        "--quantize-group-size",
        type=int,
        default=128,
        help="int4 group size: 32, 64, 128, or -1 for one group per row (a GPTQ checkpoint keeps its own)",
    )


def add_kernel_flags(parser: argparse.ArgumentParser) -> None:
    """gpu_expert's (and `up`'s) choice of quantized kernels."""
    parser.add_argument(
        "--expert-kernels",
        default="fastest",
        choices=["fastest", "exact"],
        help="quantized expert GEMMs: the fastest measured kernel per shape (some round activations or scales to "
        "bfloat16), or only those equal to the GEMM on the dequantized weights (in a 16-bit model: dequantize, "
        "then GEMM)",
    )


def positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {n}")
    return n


def add_tensor_parallel_flags(parser: argparse.ArgumentParser) -> None:
    """gpu_expert's tensor-parallel ranks (docs/parallel.md)."""
    parser.add_argument(
        "--gpus",
        type=positive_int,
        default=1,
        help="tensor-parallel ranks, one process per device (cuda:0, cuda:1, ...; on --device cpu all share the "
        "cores); each holds a slice of every expert within its own --device-memory. The weight store must "
        "run with --tensor-parallel of the same number",
    )
    parser.add_argument(
        "--tp-backend",
        default="auto",
        choices=["auto", "nccl", "gloo"],
        help="the ranks' all-reduces: auto = NCCL on CUDA, gloo on CPU; gloo on CUDA runs several ranks on one "
        "GPU (a check; NCCL refuses that)",
    )
    parser.add_argument(
        "--tp-same-device",
        action="store_true",
        help="every rank on --device itself (with --tp-backend gloo): a check of several ranks on one GPU",
    )
    parser.add_argument(
        "--tp-timeout",
        type=float,
        default=60.0,
        help="seconds any collective may wait for the other ranks before the group counts as broken",
    )
    parser.add_argument(
        "--tp-startup-timeout", type=float, default=900.0, help="seconds the ranks may take to build their slices"
    )
    parser.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)  # set by rank 0 for the others
    parser.add_argument("--tp-rendezvous", default=None, help=argparse.SUPPRESS)
