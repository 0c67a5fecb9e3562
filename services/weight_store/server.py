"""weight_store: loads a checkpoint into a paged shared-memory arena and serves its page table."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import structlog
import torch
from prometheus_client import Gauge

from moe_lightning.api.weight_store.v1 import weight_store_pb2, weight_store_pb2_grpc
from moe_lightning.flags import (
    EnvDefaultsParser,
    add_quantize_flags,
    add_service_flags,
    internal_address,
    positive_int,
)
from moe_lightning.quant.resolve import resolve_scheme
from moe_lightning.service.convert import model_info_to_pb, pages_to_pb
from moe_lightning.service.errors import NotReadyError
from moe_lightning.service.names import WEIGHT_STORE
from moe_lightning.service.runtime import ServiceRuntime, serve
from moe_lightning.spec import DTYPE_CHOICES, ModelSpec, resolve_dtype
from moe_lightning.tensor_parallel import check_splittable
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
    add_service_flags(p, internal_address("weight_store"))
    p.add_argument("--model", required=True, type=Path, help="HF checkpoint directory")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="dtype of the arena's weights (auto: the checkpoint's 16-bit dtype when a GPU is visible, else float32)",
    )
    add_quantize_flags(p)
    p.add_argument(
        "--tensor-parallel",
        type=positive_int,
        default=1,
        help="gpu_expert's ranks (its --gpus): each expert is laid out as that many slices, one range each",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where the converted copy is kept (default: ~/.cache/moe-lightning/arena; in a container, a volume)",
    )
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the converted copy")
    p.add_argument("--no-progress", action="store_true")
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
    args: argparse.Namespace, servicer: WeightStoreServicer, runtime: ServiceRuntime
) -> dict[str, Any]:
    """_start; a failure of a kind not expected from a bad checkpoint or a full /dev/shm keeps its traceback
    in the log (serve() logs only the message), since it may be a bug rather than bad input."""
    try:
        return _start(args, servicer, runtime)
    except (ValueError, OSError):
        raise  # CheckpointError and the like: the message names the file and says what is wrong
    except Exception:
        structlog.get_logger().exception("startup_unexpected_error", model=str(args.model))
        raise


def _start(args: argparse.Namespace, servicer: WeightStoreServicer, runtime: ServiceRuntime) -> dict[str, Any]:
    """Fills the arena (or adopts a predecessor's); the fields of the `serving` line."""
    spec = ModelSpec.from_pretrained(args.model)
    tokenizer = TextTokenizer.from_model_dir(args.model)
    if tokenizer is not None:
        tokenizer.check_fits(spec.vocab_size, args.model)
    dtype = resolve_dtype(args.dtype, spec.dtype, "cuda" if torch.cuda.is_available() else "cpu")
    cache_dir = None if args.no_cache else args.cache_dir or default_cache_dir()
    scheme = resolve_scheme(args.model, args.quantize, args.quantize_group_size)
    check_splittable(spec, args.tensor_parallel, scheme)
    arena = WeightArena(args.model, spec, dtype, cache_dir, args.run_id, scheme, args.tensor_parallel)
    runtime.on_shutdown(arena.close)  # before the load: a load that fails still releases the arena
    report = arena.load(progress=not args.no_progress)
    servicer.ready(arena, report)
    ARENA_BYTES.set(arena.layout.total_bytes)
    PAGES.set(len(arena.layout.pages))
    source = "adopted" if report.adopted else "copy" if report.from_cache else "checkpoint"
    LOAD_SECONDS.labels(source).set(report.seconds)
    return {
        "region": arena.segment.name,
        "bytes": arena.layout.total_bytes,
        "experts": scheme.key(),
        "tensor_parallel": args.tensor_parallel,
        "from_cache": report.from_cache,
        "adopted": report.adopted,
        "load_seconds": round(report.seconds, 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    servicer = WeightStoreServicer(args.model)
    return serve(
        args,
        "weight_store",
        WEIGHT_STORE,
        weight_store_pb2_grpc.add_WeightStoreServicer_to_server,
        servicer,
        lambda runtime: _start_explained(args, servicer, runtime),
        # anything: a checkpoint is operator input, and whatever it makes fail (a bad file, a full /dev/shm,
        # a library's own error) must release the arena and exit 1 naming the file, not leave a segment behind
        failures=(Exception,),
        keep_segments=(ARENA, READY),  # the predecessor's arena may be adopted, not swept
    )


if __name__ == "__main__":
    sys.exit(main())
