"""Fills the weight arena in shared memory, from the on-disk converted copy when there is one.

A restarted weight store adopts its dead predecessor's arena when it is complete and of the same
checkpoint and dtype (a small `arena-ready` segment holding the checkpoint key says so, written once
the arena is filled): gpu_expert still maps that arena, so filling a new one would hold the weights
twice in host memory (for Mixtral 8x7B in bf16, 2 x 93 GB) and take a conversion's time.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
from prometheus_client import Gauge
from tqdm import tqdm

from moe_lightning.arena_layout import ArenaLayout, checkpoint_key, layout_from_json, layout_to_json
from moe_lightning.quant.scheme import QuantScheme
from moe_lightning.shm.segment import (
    SHM_DIR,
    Segment,
    adopt,
    leftover_stat,
    pid_alive,
    read_leftover,
    segment_name,
    stale_segments,
)
from moe_lightning.spec import ModelSpec

READ_CHUNK = 256 << 20
# A benchmark waits for 0: the copy's reads of the arena compete with the stack's for memory bandwidth
COPY_PENDING = Gauge("moe_lightning_arena_copy_pending", "1 while the converted copy is being written to disk")


ARENA, READY = "arena", "arena-ready"  # segment <what>s; bootstrap keeps them for adoption


@dataclass(slots=True)
class LoadReport:
    seconds: float
    from_cache: bool
    key: str
    adopted: bool = False  # the predecessor's arena, taken over as it was


class WeightArena:
    def __init__(
        self,
        model_dir: Path,
        spec: ModelSpec,
        dtype: str,
        cache_dir: Path | None,
        run_id: str,
        scheme: QuantScheme | None = None,
        ranks: int = 1,
    ) -> None:
        self.model_dir = model_dir
        self.spec = spec
        self.dtype = dtype
        self.cache_dir = cache_dir
        self.layout = ArenaLayout.for_spec(spec, dtype, scheme, ranks)  # each rank's slice of an expert: one range
        self.log = structlog.get_logger()
        self.run_id = run_id
        self.key = checkpoint_key(model_dir, dtype, scheme, ranks)  # the format too: an int4 arena is not an fp32 one
        name = segment_name(run_id, "weight_store", ARENA)
        self.adopted = self._adopt_predecessor(name)
        if self.adopted:
            self.segment = Segment.attach(name)
        else:
            self.segment = Segment.create(name, self.layout.total_bytes, f"the weight arena of {model_dir.name}")
        self._ready: Segment | None = None
        self._writer: threading.Thread | None = None
        self._closing = threading.Event()

    def _adopt_predecessor(self, name: str) -> bool:
        """Renames a dead predecessor's complete, matching arena to `name`; removes the other leftovers."""
        leftovers = stale_segments(self.run_id, "weight_store", at_startup=True)
        arenas = {m["pid"]: path for path, m in leftovers if m["what"] == ARENA}
        ready = {m["pid"]: path for path, m in leftovers if m["what"] == READY}
        chosen = None
        for pid, path in arenas.items():
            # stale_segments kept only leftovers of ours; checked again on the descriptor we read
            # through (never following a link, never blocking on a FIFO), as the file may be swapped
            st = leftover_stat(path)
            raw = read_leftover(ready[pid], len(self.key.encode()) + 1) if pid in ready else None
            if st is None or raw is None:
                continue
            try:
                key = raw.rstrip(b"\0").decode()
            except UnicodeDecodeError:
                continue
            if key == self.key and st.st_size == self.layout.total_bytes:
                chosen = (path, st)
                break
        for path, _ in leftovers:
            if chosen is None or path != chosen[0]:
                try:
                    path.unlink(missing_ok=True)
                except OSError as exc:  # a start never aborts on a leftover it cannot remove
                    self.log.warning("stale_segment_not_removed", path=str(path), error=str(exc))
        if chosen is None:
            return False
        try:
            adopt(chosen[0], name, expect=chosen[1])
        except OSError as exc:
            self.log.warning("arena_not_adopted", predecessor=chosen[0].name, error=str(exc))
            return False
        self.log.info("arena_adopted", predecessor=chosen[0].name, bytes=self.layout.total_bytes)
        return True

    def _mark_ready(self) -> None:
        """The arena is complete: a successor may adopt it (the segment dies with a clean stop)."""
        key = self.key.encode()
        self._ready = Segment.create(segment_name(self.run_id, "weight_store", READY), len(key))
        self._ready.buf[: len(key)] = key

    def _cache_paths(self, key: str) -> tuple[Path, Path]:
        assert self.cache_dir is not None
        return self.cache_dir / f"{key}.arena", self.cache_dir / f"{key}.json"

    def load(self, progress: bool = True) -> LoadReport:
        t0 = time.perf_counter()
        key = self.key
        copy_ok = False
        if self.cache_dir is not None:
            data, manifest = self._cache_paths(key)
            try:
                copy_ok = data.is_file() and manifest.is_file() and self._cache_matches(manifest, data)
            except OSError as exc:  # an unreadable cache directory (another user's, a read-only mount): convert
                self.log.warning("arena_copy_unreadable", cache_dir=str(self.cache_dir), error=str(exc))
        if self.adopted:
            report = LoadReport(time.perf_counter() - t0, False, key, adopted=True)
        elif copy_ok:
            self._read_copy(self._cache_paths(key)[0], progress)
            report = LoadReport(time.perf_counter() - t0, True, key)
            self.log.info("arena_mapped_from_copy", seconds=round(report.seconds, 3))
        else:
            # here, not at the top: a store serving from its copy never imports torch (~1.3 s of CPU at
            # every start, beside the other services' imports of it on the same cores)
            from moe_lightning.arena import fill_arena

            fill_arena(self.segment.bytes(), self.layout, self.model_dir, self.spec, progress)
            report = LoadReport(time.perf_counter() - t0, False, key)
            self.log.info("arena_converted", model_dir=str(self.model_dir), seconds=round(report.seconds, 3))
        self._mark_ready()
        if self.cache_dir is not None and not copy_ok:
            # Written after we are serving; a crash mid-write leaves only a .tmp file behind.
            self._writer = threading.Thread(target=self._write_copy, args=(key,), name="arena-copy", daemon=True)
            COPY_PENDING.set(1)
            self._writer.start()
        return report

    def _cache_matches(self, manifest: Path, data: Path) -> bool:
        try:
            cached = layout_from_json(manifest.read_text())
        except (ValueError, KeyError):
            return False
        return cached == self.layout and data.stat().st_size == self.layout.total_bytes

    def _read_copy(self, path: Path, progress: bool) -> None:
        total = self.layout.total_bytes
        shm_file = SHM_DIR / self.segment.name.lstrip("/")
        with (
            path.open("rb", buffering=0) as f,
            tqdm(
                total=total, unit="B", unit_scale=True, desc="mapping arena copy", disable=not progress, leave=False
            ) as bar,
        ):
            if shm_file.exists():  # Linux: the segment is a tmpfs file; let the kernel copy (~1.5x faster)
                with shm_file.open("r+b", buffering=0) as out:
                    done = 0
                    while done < total:
                        n = os.sendfile(out.fileno(), f.fileno(), done, min(READ_CHUNK, total - done))
                        if not n:
                            raise OSError(f"{path} ended after {done} of {total} bytes")
                        done += n
                        bar.update(n)
                return
            buf = memoryview(self.segment.buf)
            done = 0
            while done < total:
                n = f.readinto(buf[done : min(total, done + READ_CHUNK)])
                if not n:
                    raise OSError(f"{path} ended after {done} of {total} bytes")
                done += n
                bar.update(n)
            buf.release()

    def _write_copy(self, key: str) -> None:
        data, manifest = self._cache_paths(key)
        tmp = data.with_suffix(f".tmp{os.getpid()}")
        try:
            data.parent.mkdir(parents=True, exist_ok=True)
            for stale in data.parent.glob(f"{data.stem}.tmp*"):  # a predecessor killed mid-write
                pid = stale.suffix.removeprefix(".tmp")
                if pid.isdigit() and not pid_alive(int(pid)):
                    stale.unlink(missing_ok=True)
            with tmp.open("wb") as f:
                buf = memoryview(self.segment.buf)
                try:
                    for start in range(0, self.layout.total_bytes, READ_CHUNK):
                        if self._closing.is_set():
                            raise InterruptedError("the weight store is stopping")
                        f.write(buf[start : start + READ_CHUNK])
                finally:
                    buf.release()
            tmp.rename(data)
            manifest.write_text(layout_to_json(self.layout))
            self.log.info("arena_copy_written", path=str(data), bytes=self.layout.total_bytes)
        except (OSError, ValueError) as exc:
            tmp.unlink(missing_ok=True)  # a partial copy is never left behind
            self.log.warning("arena_copy_failed", error=str(exc))
        finally:
            COPY_PENDING.set(0)

    def close(self) -> None:
        self._closing.set()
        if self._writer is not None:
            self._writer.join(timeout=30)  # it stops at the next chunk and removes its partial file
        for seg in (self._ready, self.segment):
            if seg is not None:
                try:
                    seg.close()
                finally:  # a failed unmap must not leave the segment's name in /dev/shm
                    seg.unlink()
