"""weight_store: loads a checkpoint into a paged shared-memory arena and serves its page table."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import structlog
from prometheus_client import Gauge

from moe_lightning.api.weight_store.v1 import weight_store_pb2, weight_store_pb2_grpc
from moe_lightning.config.checks import check_splittable, resolve_expert_scheme
from moe_lightning.config.flag import EnvDefaultsParser
from moe_lightning.config.service import internal_address
from moe_lightning.config.weight_store import WeightStoreConfig
from moe_lightning.quant.gptq_config import read_gptq_config
from moe_lightning.service.convert import model_info_to_pb, pages_to_pb
from moe_lightning.service.errors import NotReadyError
from moe_lightning.service.names import WEIGHT_STORE
from moe_lightning.service.runtime import ServiceRuntime, serve
from moe_lightning.spec import ModelSpec, resolve_dtype
from moe_lightning.spec_bounds import check_checkpoint_holds
from moe_lightning.tokenizer import TextTokenizer
from services.weight_store.store import ARENA, READY, LoadReport, WeightArena

ARENA_BYTES = Gauge("moe_lightning_weight_arena_bytes", "Size of the weight arena in shared memory")
LOAD_SECONDS = Gauge("moe_lightning_weight_load_seconds", "Time to fill the arena", ["source"])
PAGES = Gauge("moe_lightning_weight_pages", "Pages (tensors) in the arena")


class WeightStoreServicer(weight_store_pb2_grpc.WeightStoreServicer):
    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._loaded: tuple[WeightArena, LoadReport] | None = None  # one assignment: never half ready

    def ready(self, arena: WeightArena, report: LoadReport) -> None:
        """The arena is filled: GetManifest answers from now on."""
        self._loaded = (arena, report)

    def GetManifest(
        self, request: weight_store_pb2.GetManifestRequest, context: grpc.ServicerContext
    ) -> weight_store_pb2.GetManifestResponse:
        if self._loaded is None:
            raise NotReadyError("the weight arena is still loading; retry when health is SERVING")
        a, report = self._loaded
        return weight_store_pb2.GetManifestResponse(
            region=a.segment.name,
            region_bytes=a.layout.total_bytes,
            model=model_info_to_pb(a.spec, str(self.model_dir)),
            pages=pages_to_pb(a.layout, a.segment.name),
            checkpoint_key=report.key,
            load_seconds=report.seconds,
            from_cache=report.from_cache,
            adopted=report.adopted,
        )


def build_parser() -> EnvDefaultsParser:
    p = EnvDefaultsParser(prog="moe-lightning-weight-store", description=__doc__)
    WeightStoreConfig.add_cli_args(p, defaults={"address": internal_address("weight_store")})
    return p


def default_cache_dir() -> Path | None:
    """~/.cache/moe-lightning/arena, or None (no copy) when there is no home to resolve: a container user
    without a passwd entry must still start; a home that exists but cannot be written is a warning later."""
    try:
        return Path.home() / ".cache" / "moe-lightning" / "arena"
    except RuntimeError:  # "Could not determine home directory"
        structlog.get_logger().warning("arena_cache_disabled", reason="no home directory; set --cache-dir")
        return None


def _start_explained(
    config: WeightStoreConfig, servicer: WeightStoreServicer, runtime: ServiceRuntime
) -> dict[str, Any]:
    """_start; a failure of a kind not expected from a bad checkpoint or a full /dev/shm keeps its traceback
    in the log (serve() logs only the message), since it may be a bug rather than bad input."""
    try:
        return _start(config, servicer, runtime)
    except (ValueError, OSError):
        raise  # CheckpointError and the like: the message names the file and says what is wrong
    except Exception:
        structlog.get_logger().exception("startup_unexpected_error", model=str(config.model))
        raise


def _device() -> str:
    """Where `--dtype auto` assumes the experts run, when the store is started alone (the launcher
    passes the dtype it resolved for gpu_expert's device, and the store then needs no torch)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _start(config: WeightStoreConfig, servicer: WeightStoreServicer, runtime: ServiceRuntime) -> dict[str, Any]:
    """Fills the arena (or adopts a predecessor's); the fields of the `serving` line."""
    c = config
    spec = ModelSpec.from_pretrained(c.model)
    check_checkpoint_holds(spec, c.model)  # before the arena's layout and segment are made for it
    tokenizer = TextTokenizer.from_model_dir(c.model)
    if tokenizer is not None:
        tokenizer.check_fits(spec.vocab_size, c.model)
    dtype = c.dtype if c.dtype != "auto" else resolve_dtype(c.dtype, spec.dtype, _device())
    cache_dir = None if c.no_cache else c.cache_dir or default_cache_dir()
    # the launcher asked these before it started anything (config.checks.check_stack); alone, here
    scheme = resolve_expert_scheme(spec, c.model, c.quantize, c.quantize_group_size, c.tensor_parallel)
    if c.quantize == "int4" and c.quantize_group_size is None and read_gptq_config(c.model) is None:
        runtime.log.info(
            "int4_group_size", chosen=scheme.group_size, why="the largest of 128, 64, 32 dividing every width"
        )
    check_splittable(spec, c.tensor_parallel, scheme)
    arena = WeightArena(c.model, spec, dtype, cache_dir, c.run_id, scheme, c.tensor_parallel)
    runtime.on_shutdown(arena.close)  # before the load: a load that fails still releases the arena
    report = arena.load(progress=not c.no_progress)
    servicer.ready(arena, report)
    ARENA_BYTES.set(arena.layout.total_bytes)
    PAGES.set(len(arena.layout.pages))
    source = "adopted" if report.adopted else "copy" if report.from_cache else "checkpoint"
    LOAD_SECONDS.labels(source).set(report.seconds)
    return {
        "region": arena.segment.name,
        "bytes": arena.layout.total_bytes,
        "experts": scheme.key(),
        "tensor_parallel": c.tensor_parallel,
        "from_cache": report.from_cache,
        "adopted": report.adopted,
        "load_seconds": round(report.seconds, 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    config = WeightStoreConfig.from_cli_args(build_parser().parse_args(argv))
    servicer = WeightStoreServicer(config.model)
    return serve(
        config,
        "weight_store",
        WEIGHT_STORE,
        weight_store_pb2_grpc.add_WeightStoreServicer_to_server,
        servicer,
        lambda runtime: _start_explained(config, servicer, runtime),
        # anything: a checkpoint is operator input, and whatever it makes fail (a bad file, a full /dev/shm,
        # a library's own error) must release the arena and exit 1 naming the file, not leave a segment behind
        failures=(Exception,),
        keep_segments=(ARENA, READY),  # the predecessor's arena may be adopted, not swept
    )


if __name__ == "__main__":
    sys.exit(main())
