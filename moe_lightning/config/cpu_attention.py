"""cpu_attention's config: its KV cache on the host, and the worker flags it shares with gpu_expert."""

from __future__ import annotations

from dataclasses import dataclass

from moe_lightning.config import flags
from moe_lightning.config.flag import REQUIRED, option
from moe_lightning.config.host_memory import AUTO
from moe_lightning.config.service import ServiceConfig, WorkerConfig

DEFAULT_KV_CACHE_MEMORY = AUTO  # config/host_memory.py


@dataclass(kw_only=True)
class CpuAttentionConfig(WorkerConfig, ServiceConfig):
    weight_store: str = option(flags.WEIGHT_STORE, REQUIRED)
    kv_cache_memory: int | str = option(flags.KV_CACHE_MEMORY, DEFAULT_KV_CACHE_MEMORY)  # bytes, or auto
    kv_dtype: str = option(flags.KV_DTYPE, "auto")  # auto: the arena's weight dtype (the manifest says it)
    block_size: int = option(flags.BLOCK_SIZE, 16)
