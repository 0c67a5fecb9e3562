"""`bench --gpus N`: each tensor-parallel rank's share, measured against the HRM's multi-GPU model.

On one box of 2 cores, N ranks share the cores: the numbers are correctness and overheads (bytes
each rank streams, time in collectives per layer), not a speed-up (docs/parallel.md)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from moe_lightning.hrm.costmodel import Estimate
from moe_lightning.hrm.explain import link_bytes_per_step
from moe_lightning.spec import ModelSpec

SERIES = {
    "bytes_streamed": "moe_lightning_rank_expert_bytes_streamed_total",
    "collective_seconds": "moe_lightning_rank_collective_seconds_total",
}


def rank_shares(after: dict[str, float], delta: Callable[[str], float], steps: float) -> list[dict]:
    """Per rank, from gpu_expert's metrics (`after` the run, `delta` over it) for a run of `steps`
    steps: bytes streamed and seconds in collectives, per step."""
    ranks: dict[int, dict[str, float]] = {}
    for key in after:
        for name, series in SERIES.items():
            found = re.fullmatch(rf'{series}\{{rank="(\d+)"\}}', key)
            if found:
                ranks.setdefault(int(found[1]), {})[name] = delta(key) / max(1.0, steps)
    return [{"rank": r, **v} for r, v in sorted(ranks.items())]


def report(shares: list[dict], spec: ModelSpec, bound: Estimate, gpus: int) -> dict[str, Any]:
    """Prints the per-rank table; the HRM predicts each rank's link bytes as 1/N of the step's."""
    predicted = link_bytes_per_step(spec, bound)["expert_pages"] / gpus
    shared = not bound.link_bytes  # host and device are one memory: the HRM models no link
    print(f"tensor-parallel ranks ({gpus}), per step (prefill and decode), measured vs the HRM:")
    print(f"{'rank':>4} {'MiB streamed':>13} {'HRM MiB':>8} {'collectives ms/layer':>21}")
    rows = []
    for share in shares:
        mib = share.get("bytes_streamed", 0.0) / 2**20
        per_layer = 1e3 * share.get("collective_seconds", 0.0) / spec.num_layers
        hrm = "-" if shared else f"{predicted / 2**20:.2f}"
        print(f"{share['rank']:>4} {mib:13.2f} {hrm:>8} {per_layer:21.3f}")
        rows.append(
            {
                "rank": share["rank"],
                "bytes_streamed_per_step": share.get("bytes_streamed", 0.0),
                "collective_ms_per_layer": per_layer,
            }
        )
    return {"ranks": rows, "hrm_bytes_streamed_per_rank_per_step": predicted}
