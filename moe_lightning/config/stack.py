"""The stack's config: what `up` (and `run --model`, and bench) ask of the five processes, and how
it becomes each process's own config (`StackConfig.compose`).

StackConfig holds the user's choices once; the five per-process configs are derived from it and a
`Wiring` (the addresses and ports the launcher picked), and the launcher writes each back as argv
(CliConfig.to_argv). No flag is typed twice: each field names the same Flag the service declares.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_lightning.config import flags
from moe_lightning.config.choices import AUTO, KV_ADMISSIONS, STEP_SCHEDULES
from moe_lightning.config.cpu_attention import DEFAULT_KV_CACHE_MEMORY, CpuAttentionConfig
from moe_lightning.config.flag import REQUIRED, CliConfig, Flag, option
from moe_lightning.config.gateway import GatewayConfig
from moe_lightning.config.gpu_expert import GpuExpertConfig
from moe_lightning.config.host_memory import parse_kv_cache_memory
from moe_lightning.config.orchestrator import OrchestratorConfig
from moe_lightning.config.units import DeviceShare, parse_device_memory, parse_size
from moe_lightning.config.weight_store import WeightStoreConfig

HOST = Flag("--host", "bind address of the public API (0.0.0.0 for all)")
PORT = Flag("--port", "port of the public API (0 = any free port)", type=int)
LOG_DIR = Flag("--log-dir", "write each service's log to DIR/<service>.log", type=Path)

# in start order: the workers first (each waits for what it needs), the gateway last
SERVICE_NAMES = ("weight_store", "cpu_attention", "gpu_expert", "orchestrator", "gateway")
INTERNAL = ("weight_store", "cpu_attention", "gpu_expert")  # on unix sockets in the run's private directory
# the options of the public API's exposure: `up`'s, not `run --model`'s (whose stack binds loopback only)
EXPOSURE = (
    "model",
    "host",
    "port",
    "chat_template",
    "tool_call_parser",
    "reasoning_parser",
    "stream_interval",
    "tls_cert",
    "tls_key",
    "tls_ca",
    "auth_token",
)


@dataclass(kw_only=True)
class StackConfig(CliConfig):
    model: Path = option(flags.MODEL, REQUIRED)
    run_id: str | None = option(flags.RUN_ID)  # None: one of this process's own (up<pid>)
    host: str = option(HOST, "127.0.0.1")
    port: int = option(PORT, 50051)
    device: str = option(flags.DEVICE, "cpu")
    gpus: int = option(flags.GPUS, 1)
    device_memory: int | DeviceShare | None = option(flags.DEVICE_MEMORY)  # per device
    device_kv_memory: int | None = option(flags.DEVICE_KV_MEMORY)
    link_bandwidth: float | None = option(flags.LINK_BANDWIDTH)  # bytes/s: a simulated link for a CPU device
    attention_placement: str = option(flags.ATTENTION_PLACEMENT, "auto")
    experts_placement: str = option(flags.EXPERTS_PLACEMENT, "auto")
    chat_template: Path | None = option(flags.CHAT_TEMPLATE)
    tool_call_parser: str = option(flags.TOOL_CALL_PARSER, AUTO)
    reasoning_parser: str = option(flags.REASONING_PARSER, AUTO)
    stream_interval: int = option(flags.STREAM_INTERVAL, 1)
    tls_cert: Path | None = option(flags.TLS_CERT)  # the public API over TLS (the rest stays on unix sockets)
    tls_key: Path | None = option(flags.TLS_KEY)
    tls_ca: Path | None = option(flags.TLS_CA)  # verifies tls_cert in the readiness check (None: the cert itself)
    auth_token: str | None = option(flags.AUTH_TOKEN)  # passed by environment, not argv
    kv_cache_memory: int | str = option(flags.KV_CACHE_MEMORY, DEFAULT_KV_CACHE_MEMORY)  # bytes, or auto
    kv_admission: str = option(flags.KV_ADMISSION, KV_ADMISSIONS[0])
    step_schedule: str = option(flags.STEP_SCHEDULE, STEP_SCHEDULES[0])
    prefill_budget: int | None = option(flags.PREFILL_BUDGET)  # None: the HRM's (hrm/prefill_budget.py)
    expert_groups: int | None = option(flags.EXPERT_GROUPS)  # None: the HRM picks (0: per micro-batch)
    kv_dtype: str = option(flags.KV_DTYPE, "auto")
    dtype: str = option(flags.DTYPE, "auto")
    quantize: str = option(flags.QUANTIZE, "auto")
    quantize_group_size: int | None = option(flags.QUANTIZE_GROUP_SIZE)  # None: config.checks.int4_group_size
    expert_kernels: str = option(flags.EXPERT_KERNELS, "fastest")
    quantize_dense: str = option(flags.QUANTIZE_DENSE, "none")
    max_batch_size: int | None = option(flags.MAX_BATCH_SIZE)  # None: the orchestrator's HRM policy decides
    micro_batch_size: int | None = option(flags.MICRO_BATCH_SIZE)
    cache_dir: Path | None = option(flags.CACHE_DIR)
    log_dir: Path | None = option(LOG_DIR)  # None: services log to this process's stderr
    http_port: int | None = None  # the gateway's port on `host` (0: any free); None: no gateway
    threads: dict[str, int] = field(default_factory=dict)  # torch threads per worker service
    run_dir: Path | None = None  # the unix sockets' directory; None: a fresh private one per start
    extra: dict[str, list[str]] = field(default_factory=dict)  # more flags per service

    def __post_init__(self) -> None:
        # sizes may come as text (a test's "32MiB", a Ray job's row): one type from here on
        self.model = Path(self.model)
        if self.run_id is None:
            self.run_id = f"up{os.getpid()}"
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_kv_cache_memory(self.kv_cache_memory)
        if isinstance(self.device_kv_memory, str):
            self.device_kv_memory = parse_size(self.device_kv_memory)
        if isinstance(self.device_memory, str):
            self.device_memory = parse_device_memory(self.device_memory)
        for name in ("chat_template", "tls_cert", "tls_key", "tls_ca", "cache_dir", "log_dir", "run_dir"):
            if isinstance(getattr(self, name), str):
                setattr(self, name, Path(getattr(self, name)))

    @classmethod
    def for_command(cls, ns: argparse.Namespace, **overrides: Any) -> StackConfig:
        """The stack `up` or `run --model` asked for. `run`'s --tls-ca is its client's (of the API it
        calls), not the stack's: a stack's CA only verifies its own --tls-cert."""
        config = cls.from_cli_args(ns, **overrides)
        if config.tls_cert is None:
            config.tls_ca = None
        return config

    @property
    def services(self) -> list[str]:
        """This stack's services in start order: the four, and the HTTP gateway when it has a port."""
        return [n for n in SERVICE_NAMES if n != "gateway" or self.http_port is not None]

    def compose(self, wiring: Wiring) -> dict[str, CliConfig]:
        """Each of this stack's processes' own config."""
        return {name: cls(**fields) for name, (cls, fields) in self._composed(wiring).items()}

    def argv(self, wiring: Wiring) -> dict[str, list[str]]:
        """Each process's command line: every field the stack sets written out, even at the process's
        default (else a MOE_LIGHTNING_ variable in the environment the children inherit would win over
        what `up` was told), the others only where they differ from it."""
        return {name: cls(**fields).to_argv(explicit=fields) for name, (cls, fields) in self._composed(wiring).items()}

    def _composed(self, wiring: Wiring) -> dict[str, tuple[type[CliConfig], dict[str, Any]]]:
        return {name: _COMPOSE[name](self, wiring) for name in self.services}


@dataclass(frozen=True)
class Wiring:
    """What the launcher picked for one start: every service's address and metrics port, and the
    arena's dtype resolved for this stack's device (the weight store alone cannot know gpu_expert's)."""

    addresses: dict[str, str]
    metrics_ports: dict[str, int]
    weight_dtype: str


def _service(c: StackConfig, w: Wiring, name: str) -> dict[str, object]:
    assert c.run_id is not None
    return {"address": w.addresses[name], "metrics_port": w.metrics_ports[name], "run_id": c.run_id}


def _weight_store(c: StackConfig, w: Wiring) -> tuple[type[WeightStoreConfig], dict[str, Any]]:
    return WeightStoreConfig, dict(
        **_service(c, w, "weight_store"),
        model=c.model,
        dtype=w.weight_dtype,
        quantize=c.quantize,
        quantize_group_size=c.quantize_group_size,
        tensor_parallel=c.gpus,
        cache_dir=c.cache_dir,
        no_progress=True,
    )


def _cpu_attention(c: StackConfig, w: Wiring) -> tuple[type[CpuAttentionConfig], dict[str, Any]]:
    return CpuAttentionConfig, dict(
        **_service(c, w, "cpu_attention"),
        weight_store=w.addresses["weight_store"],
        kv_cache_memory=c.kv_cache_memory,
        kv_dtype=c.kv_dtype,
        threads=c.threads.get("cpu_attention", 0),
    )


def _gpu_expert(c: StackConfig, w: Wiring) -> tuple[type[GpuExpertConfig], dict[str, Any]]:
    return GpuExpertConfig, dict(
        **_service(c, w, "gpu_expert"),
        weight_store=w.addresses["weight_store"],
        device=c.device,
        gpus=c.gpus,
        device_memory=c.device_memory,
        device_kv_memory=c.device_kv_memory or 0,
        expert_kernels=c.expert_kernels,
        quantize_dense=c.quantize_dense,
        experts_placement=c.experts_placement,
        link_bandwidth=c.link_bandwidth,
        threads=c.threads.get("gpu_expert", 0),
    )


def _orchestrator(c: StackConfig, w: Wiring) -> tuple[type[OrchestratorConfig], dict[str, Any]]:
    a = w.addresses
    tls = c.tls_cert is not None and c.tls_key is not None
    return OrchestratorConfig, dict(
        **_service(c, w, "orchestrator"),
        weight_store=a["weight_store"],
        gpu_expert=a["gpu_expert"],
        cpu_attention=a["cpu_attention"],
        max_batch_size=c.max_batch_size,
        micro_batch_size=c.micro_batch_size,
        kv_admission=c.kv_admission,
        step_schedule=c.step_schedule,
        prefill_budget=c.prefill_budget,
        expert_groups=c.expert_groups,
        attention_placement=c.attention_placement,
        experts_placement=c.experts_placement,
        chat_template=c.chat_template,
        tool_call_parser=c.tool_call_parser,
        reasoning_parser=c.reasoning_parser,
        stream_interval=c.stream_interval,
        tls_cert=c.tls_cert if tls else None,
        tls_key=c.tls_key if tls else None,
        auth_token=c.auth_token,  # a secret: to_argv leaves it out, the launcher passes it by environment
    )


def _gateway(c: StackConfig, w: Wiring) -> tuple[type[GatewayConfig], dict[str, Any]]:
    """On the API's host, over the API (its token by environment, its TLS)."""
    from moe_lightning.service.auth import is_loopback

    tls = c.tls_cert is not None and c.tls_key is not None
    return GatewayConfig, dict(
        address=w.addresses["gateway"],
        api=w.addresses["orchestrator"],
        tls_cert=c.tls_cert if tls else None,
        tls_key=c.tls_key if tls else None,
        api_tls_ca=(c.tls_ca or c.tls_cert) if tls else None,
        auth_token=c.auth_token,
        insecure=not c.auth_token and not is_loopback(c.host),  # `up` refused this unless the user said --insecure
    )


_COMPOSE = {
    "weight_store": _weight_store,
    "cpu_attention": _cpu_attention,
    "gpu_expert": _gpu_expert,
    "orchestrator": _orchestrator,
    "gateway": _gateway,
}
