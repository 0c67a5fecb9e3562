"""The weight store's config: the checkpoint, and the arena it fills (dtype, expert format, ranks)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moe_lightning.config import flags
from moe_lightning.config.flag import REQUIRED, Flag, option
from moe_lightning.config.service import ServiceConfig
from moe_lightning.config.units import positive_int

TENSOR_PARALLEL = Flag(
    "--tensor-parallel",
    "gpu_expert's ranks (its --gpus): each expert is laid out as that many slices, one range each",
    type=positive_int,
)
NO_CACHE = Flag("--no-cache", "neither read nor write the converted copy", action="store_true")


@dataclass(kw_only=True)
class WeightStoreConfig(ServiceConfig):
    model: Path = option(flags.MODEL, REQUIRED)
    # auto resolves by the device gpu_expert runs on: the launcher, which knows it, passes it resolved;
    # started alone, the weight store resolves it by whether a GPU is visible
    dtype: str = option(flags.DTYPE, "auto")
    quantize: str = option(flags.QUANTIZE, "auto")
    quantize_group_size: int | None = option(flags.QUANTIZE_GROUP_SIZE)  # None: config.checks.int4_group_size
    tensor_parallel: int = option(TENSOR_PARALLEL, 1)
    cache_dir: Path | None = option(flags.CACHE_DIR)
    no_cache: bool = option(NO_CACHE, False)
    no_progress: bool = option(flags.NO_PROGRESS, False)
