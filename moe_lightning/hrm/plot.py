"""The hierarchical roofline picture: each level's roof, the link's roof, the plan's operating points."""

from __future__ import annotations

from pathlib import Path
from typing import IO

from moe_lightning.hrm.costmodel import Estimate
from moe_lightning.hrm.hardware import HardwareProfile


def plot_roofline(hw: HardwareProfile, est: Estimate, title: str, out: Path | IO[bytes]) -> Path | IO[bytes]:
    """A PNG, to a file or a binary stream (the orchestrator's live page)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib: pip install 'moe-lightning[plot]'") from exc
    x = np.logspace(-2, 4, 200)  # operational intensity, FLOP/byte
    fig, ax = plt.subplots(figsize=(8, 5.5))
    roofs = [
        ("device", hw.gpu_flops, hw.gpu_bandwidth, "tab:green"),
        ("host", hw.cpu_flops, hw.cpu_bandwidth, "tab:blue"),
    ]
    for name, peak, bw, color in roofs:
        ax.loglog(
            x,
            np.minimum(peak, bw * x),
            color=color,
            label=f"{name} roof ({peak / 1e12:.2g} TFLOP/s, {bw / 1e9:.3g} GB/s)",
        )
    if not hw.shared_host_device:
        # data fetched over the link: performance <= link bandwidth x intensity (per byte moved)
        ax.loglog(
            x,
            hw.h2d_bandwidth * x,
            color="tab:red",
            linestyle="--",
            label=f"link roof ({hw.h2d_bandwidth / 1e9:.3g} GB/s)",
        )
    for stage, (flops, nbytes) in est.stage_work.items():
        seconds = est.stage_seconds[stage]
        if flops <= 0 or nbytes <= 0 or seconds <= 0:
            continue
        color = "tab:green" if stage.startswith("gpu_") else "tab:blue"
        ax.scatter([flops / nbytes], [flops / seconds], color=color, zorder=3)
        ax.annotate(stage, (flops / nbytes, flops / seconds), textcoords="offset points", xytext=(5, -12), fontsize=8)
    p = est.policy
    ax.set_title(
        f"{title}\nN={p.batch}, mu={p.micro_batch_size}, attention on {p.attention}, "
        f"{est.tokens_per_second:,.0f} tok/s predicted, bound by {est.binding}",
        fontsize=10,
    )
    ax.set_xlabel("operational intensity (FLOP / byte)")
    ax.set_ylabel("performance (FLOP/s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120, format=None if isinstance(out, Path) else "png")  # a file: its suffix says
    plt.close(fig)
    return out
