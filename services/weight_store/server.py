"""weight_store: loads a checkpoint into a paged shared-memory arena and serves its page table."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
import torch
from prometheus_client import Gauge

from moe_lightning.api.weight_store.v1 import weight_store_pb2, weight_store_pb2_grpc
from moe_lightning.flags import EnvDefaultsParser, add_service_flags
from moe_lightning.service.convert import model_info_to_pb, pages_to_pb
from moe_lightning.service.errors import NotReadyError
from moe_lightning.service.runtime import bootstrap
from moe_lightning.spec import DTYPE_CHOICES, ModelSpec, resolve_dtype
from moe_lightning.tokenizer import TextTokenizer
from services.weight_store.store import ARENA, READY, LoadReport, WeightArena

SERVICE = "moe_lightning.api.weight_store.v1.WeightStore"
ARENA_BYTES = Gauge("moe_lightning_weight_arena_bytes", "Size of the weight arena in shared memory")
LOAD_SECONDS = Gauge("moe_lightning_weight_load_seconds", "Time to fill the arena", ["source"])
PAGES = Gauge("moe_lightning_weight_pages", "Pages (tensors) in the arena")


class WeightStoreServicer(weight_store_pb2_grpc.WeightStoreServicer):
    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.arena: WeightArena | None = None
        self.report: LoadReport | None = None

    def GetManifest(
        self, request: weight_store_pb2.GetManifestRequest, context: grpc.ServicerContext
    ) -> weight_store_pb2.GetManifestResponse:
        a = self.arena
        if self.report is None or a is None:
            raise NotReadyError("the weight arena is still loading; retry when health is SERVING")
        return weight_store_pb2.GetManifestResponse(
            region=a.segment.name,
            region_bytes=a.layout.total_bytes,
            model=model_info_to_pb(a.spec, str(self.model_dir)),
            pages=pages_to_pb(a.layout, a.segment.name),
            checkpoint_key=self.report.key,
            load_seconds=self.report.seconds,
            from_cache=self.report.from_cache,
            adopted=self.report.adopted,
        )


def build_parser() -> EnvDefaultsParser:
    p = EnvDefaultsParser(prog="moe-lightning-weight-store", description=__doc__)
    add_service_flags(p, "127.0.0.1:50061")
    p.add_argument("--model", required=True, type=Path, help="HF checkpoint directory")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="dtype of the arena's weights (auto: the checkpoint's 16-bit dtype when a GPU is visible, else float32)",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=Path.home() / ".cache" / "moe-lightning" / "arena",
        help="where the converted copy is kept",
    )
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the converted copy")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    servicer = WeightStoreServicer(args.model)
    log, runtime = bootstrap(
        args,
        "weight_store",
        SERVICE,
        weight_store_pb2_grpc.add_WeightStoreServicer_to_server,
        servicer,
        keep_segments=(ARENA, READY),  # the predecessor's arena may be adopted, not swept
    )
    try:
        spec = ModelSpec.from_pretrained(args.model)
        tokenizer = TextTokenizer.from_model_dir(args.model)
        if tokenizer is not None:
            tokenizer.check_fits(spec.vocab_size, args.model)
        dtype = resolve_dtype(args.dtype, spec.dtype, "cuda" if torch.cuda.is_available() else "cpu")
        arena = WeightArena(args.model, spec, dtype, None if args.no_cache else args.cache_dir, args.run_id)
        runtime.on_shutdown(arena.close)
        report = arena.load(progress=not args.no_progress)
    except (ValueError, OSError) as exc:
        log.error("startup_failed", error=str(exc))
        runtime.stop()
        return 1
    servicer.arena = arena
    servicer.report = report
    ARENA_BYTES.set(arena.layout.total_bytes)
    PAGES.set(len(arena.layout.pages))
    source = "adopted" if report.adopted else "copy" if report.from_cache else "checkpoint"
    LOAD_SECONDS.labels(source).set(report.seconds)
    runtime.set_serving(True)
    log.info(
        "serving",
        region=arena.segment.name,
        bytes=arena.layout.total_bytes,
        from_cache=report.from_cache,
        adopted=report.adopted,
        load_seconds=round(report.seconds, 3),
    )
    runtime.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
