"""Per (step, layer, micro-batch, resource) start/end times: recorded by each service, merged after.

Services append events to a JSON-lines file (`--timeline FILE`) and keep the last ones in memory
(`--timeline-keep`), which the orchestrator asks for to draw the pipeline live (its /debug pages);
all use CLOCK_MONOTONIC (`perf_counter_ns`), so events from different processes line up. `merge`
turns them into a Chrome trace (opens in Perfetto) and a Parquet table, and `summarize` reports each
resource's busy fraction and how much of one resource's work ran while another was busy (hidden
behind it).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any


@dataclass(frozen=True, slots=True)
class Event:
    resource: str  # "device", "cpu", "copy"
    stage: str
    step: int
    layer: int
    micro_batch: int
    start_ns: int
    end_ns: int
    service: str


class TimelineRecorder:
    """Thread-safe, line-buffered; a no-op when no file is given and nothing is kept.

    `keep`: the last `keep` events also stay in memory (plain tuples, no JSON: cheap enough to be on
    by default), for `recent`; the oldest are dropped first."""

    def __init__(self, path: str | Path | None, service: str, keep: int = 0) -> None:
        self.service = service
        self._file: IO[str] | None = Path(path).open("a", buffering=1) if path else None  # noqa: SIM115 (lives with the service)
        self._recent: deque[tuple[str, str, int, int, int, int, int]] | None = deque(maxlen=keep) if keep > 0 else None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._file is not None or self._recent is not None

    def record(
        self,
        resource: str,
        stage: str,
        step: int,
        layer: int,
        micro_batch: int,
        start_ns: int,
        end_ns: int | None = None,
    ) -> None:
        if self._file is None and self._recent is None:
            return
        end = end_ns or time.perf_counter_ns()
        with self._lock:
            if self._recent is not None:
                self._recent.append((resource, stage, step, layer, micro_batch, start_ns, end))
            if self._file is not None:
                e = Event(resource, stage, step, layer, micro_batch, start_ns, end, self.service)
                self._file.write(json.dumps(asdict(e)) + "\n")

    def recent(self, steps: int = 0, start_ns: int = 0, end_ns: int = 0) -> list[Event]:
        """The kept events of the last `steps` steps (with those of no step, such as expert copies,
        that overlap them), or with `steps` 0 those overlapping [start_ns, end_ns] (0: open)."""
        with self._lock:
            kept = list(self._recent or ())
        if steps > 0:
            # the newest step ids as recorded (a restarted orchestrator counts from 0 again); a step's
            # own spans are recorded once it has ended, so each of them is whole
            last: dict[int, None] = {}
            for e in reversed(kept):
                if e[2] >= 0 and e[2] not in last:
                    if len(last) == steps:
                        break
                    last[e[2]] = None
            mine = [e for e in kept if e[2] in last]
            if not mine:
                return []
            start_ns, end_ns = min(e[5] for e in mine), max(e[6] for e in mine)
        chosen = [e for e in kept if e[6] > start_ns and (not end_ns or e[5] < end_ns)]
        return sorted((Event(*e, self.service) for e in chosen), key=lambda e: e.start_ns)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def load(paths: Iterable[str | Path]) -> list[Event]:
    events = []
    for path in paths:
        p = Path(path)
        if p.exists():
            events += [Event(**json.loads(line)) for line in p.read_text().splitlines() if line.strip()]
    return sorted(events, key=lambda e: e.start_ns)


def to_chrome_trace(events: list[Event]) -> dict[str, Any]:
    t0 = min((e.start_ns for e in events), default=0)
    lanes = {r: i for i, r in enumerate(sorted({e.resource for e in events}))}
    trace = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": r}} for r, tid in lanes.items()]
    trace += [
        {
            "name": f"{e.stage} L{e.layer} mb{e.micro_batch}",
            "cat": e.stage,
            "ph": "X",
            "pid": 1,
            "tid": lanes[e.resource],
            "ts": (e.start_ns - t0) / 1e3,
            "dur": (e.end_ns - e.start_ns) / 1e3,
            "args": {"step": e.step, "layer": e.layer, "micro_batch": e.micro_batch, "service": e.service},
        }
        for e in events
    ]
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write(events: list[Event], chrome_path: Path | None = None, parquet_path: Path | None = None) -> None:
    if chrome_path is not None:
        chrome_path.write_text(json.dumps(to_chrome_trace(events)))
    if parquet_path is not None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([asdict(e) for e in events]), parquet_path)


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    total, j = 0, 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            total += max(0, min(e, b[k][1]) - max(s, b[k][0]))
            k += 1
    return total


def summarize(events: list[Event]) -> dict[str, Any]:
    """Busy fraction per resource over the whole span, and the share of each resource's busy time that
    ran while another resource was busy ("hidden" behind it)."""
    if not events:
        return {"span_seconds": 0.0, "busy_fraction": {}, "hidden_fraction": {}}
    span = max(e.end_ns for e in events) - min(e.start_ns for e in events)
    busy = {
        r: _union([(e.start_ns, e.end_ns) for e in events if e.resource == r]) for r in {e.resource for e in events}
    }
    total = {r: sum(e - s for s, e in iv) for r, iv in busy.items()}
    hidden = {}
    for r, iv in busy.items():
        others = _union([x for o, ivs in busy.items() if o != r for x in ivs])
        hidden[r] = _overlap(iv, others) / total[r] if total[r] else 0.0
    return {
        "span_seconds": span / 1e9,
        "busy_fraction": {r: t / span for r, t in total.items()},
        "hidden_fraction": hidden,
        "overlap_seconds": {
            f"{a}&{b}": _overlap(busy[a], busy[b]) / 1e9 for a in sorted(busy) for b in sorted(busy) if a < b
        },
    }
