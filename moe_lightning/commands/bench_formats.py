"""bench --compare-quantize none,int8,int4: the expert formats against each other in one run.

Each format runs the same batch through a fresh stack with the experts streamed through the device
buffers (the placement where the bytes of an expert page bind) at the bench's --device-memory. The
result is each format's decode tok/s and expert bytes streamed per step, as ratios to the first
format, and which kernel won each shape (docs/quantization.md).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_lightning.config.checks import dense_and_expert_bytes, resolve_expert_scheme, share_budget
from moe_lightning.config.units import DeviceShare
from moe_lightning.quant.scheme import QuantFormat

if TYPE_CHECKING:
    from moe_lightning.spec import ModelSpec

# targets on the dev box (issue 15): bytes per step / 3.5 for int8 and / 6 for int4 against fp32;
# decode tok/s >= 1.3x for int8 and never below fp32
BYTES_TARGET = {QuantFormat.INT8: 3.5, QuantFormat.INT4: 6.0}
SPEED_TARGET = {QuantFormat.INT8: 1.3, QuantFormat.INT4: 1.0}
KERNEL_SERIES = re.compile(
    r'^moe_lightning_(expert|dense)_kernel_seconds\{kernel="(\w+)",rows="(\d+)",shape="(\S+)"\}$'
)


def device_memory_for(
    asked: int | DeviceShare | None,
    model: Path,
    spec: ModelSpec,
    dtype: str,
    fmt: QuantFormat | None,
    group_size: int | None,
    world: int = 1,
) -> int | None:
    """`--device-memory` as gpu_expert takes it: "25%" is the dense weights plus that share of the
    expert pages, in the run's expert format (`fmt` None: the checkpoint's own), so every format
    keeps the same number of experts on the device and streams the rest."""
    if not isinstance(asked, DeviceShare):
        return asked
    from moe_lightning.arena_layout import ArenaLayout

    scheme = resolve_expert_scheme(spec, model, "auto" if fmt is None else fmt.value, group_size, world)
    dense, expert = dense_and_expert_bytes(ArenaLayout.for_spec(spec, dtype, scheme), spec)
    return share_budget(asked, dense, expert, spec.total_experts)


def kernels_chosen(gpu_expert_metrics: dict[str, float], weights: str = "expert") -> dict[str, dict[int, str]]:
    """{weight shape: {rows bucket: kernel}} from gpu_expert's metrics: the quantized weights' kernels
    (`weights` "expert"), or the dense (fp32/bf16) weights' GEMMs a CPU races ("dense")."""
    out: dict[str, dict[int, str]] = {}
    for key in gpu_expert_metrics:
        found = KERNEL_SERIES.match(key)
        if found and found[1] == weights:
            out.setdefault(found[4], {})[int(found[3])] = found[2]
    return {shape: dict(sorted(rows.items())) for shape, rows in sorted(out.items())}


PLACEMENTS = {"gpu": "streamed", "cpu": "computed in place"}  # --experts-placement -> what it means here


def compare_formats(
    formats: list[QuantFormat], run_one: Callable[[QuantFormat], dict[str, Any]], placement: str = "gpu"
) -> dict[str, dict[str, Any]]:
    """Runs each format (`run_one` returns the bench's numbers of one run) and prints the table."""
    results: dict[str, dict[str, Any]] = {}
    for fmt in formats:
        sys.stderr.write(f"ours with {fmt} experts, {PLACEMENTS[placement]}...\n")
        results[fmt.value] = run_one(fmt)
    base = results[formats[0].value]
    print(f"expert formats, experts {PLACEMENTS[placement]} (ratios against {formats[0]}):")
    print(
        f"{'format':8} {'decode tok/s':>12} {'ratio':>6} {'target':>7} "
        f"{'MiB streamed/step':>18} {'/ it':>6} {'target':>7}"
    )
    for fmt in formats:
        r = results[fmt.value]
        speed = (
            r["decode_tokens_per_second"] / base["decode_tokens_per_second"] if base["decode_tokens_per_second"] else 0
        )
        fewer = base["expert_bytes_per_step"] / r["expert_bytes_per_step"] if r["expert_bytes_per_step"] else 0
        r["ratios"] = {"decode_tokens_per_second": speed, "bytes_per_step_reduction": fewer}
        against_none = formats[0] is QuantFormat.NONE and fmt is not QuantFormat.NONE
        t_speed = f">= {SPEED_TARGET[fmt]}" if against_none and placement == "gpu" else ">= 1.0" if against_none else ""
        t_bytes = f">= {BYTES_TARGET[fmt]}" if against_none and placement == "gpu" else ""
        print(
            f"{fmt.value:8} {r['decode_tokens_per_second']:12.1f} {speed:6.2f} {t_speed:>7} "
            f"{r['expert_bytes_per_step'] / 2**20:18.1f} {fewer:6.2f} {t_bytes:>7}"
        )
    for fmt in formats:
        for shape, rows in results[fmt.value].get("kernels", {}).items():
            print(f"  {fmt.value} {shape}: " + ", ".join(f"{n} rows {k}" for n, k in rows.items()))
    return results
