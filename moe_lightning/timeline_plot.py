"""A picture of the CGOPipe schedule: one lane per resource (device, cpu, copy) over a few layers of
one decode step, each box a stage of one (layer, micro-batch), so overlap can be seen at a glance."""

from __future__ import annotations

from pathlib import Path
from typing import IO

from moe_lightning.timeline import Event

COLORS = {
    "pre_attention": "tab:green",
    "post_attention": "tab:olive",
    "group_experts": "tab:orange",  # a group's FFN, once for its micro-batches (--expert-groups)
    "attention": "tab:blue",
    "expert_copy": "tab:red",
    "head": "tab:gray",
}
LANES = ("device", "cpu", "copy")


def decode_window(events: list[Event], layers: int = 3) -> tuple[int, int, int]:
    """(step, start ns, end ns): the first `layers` layers of the middle decode step (the step whose
    micro-batches all carry one token is not known here, so: the middle step that has most events)."""
    steps = sorted({e.step for e in events if e.step >= 0})
    if not steps:
        raise ValueError("the timeline has no step events")
    step = steps[len(steps) // 2]
    mine = [e for e in events if e.step == step and 0 <= e.layer < layers]
    return step, min(e.start_ns for e in mine), max(e.end_ns for e in mine)


def plot_timeline(events: list[Event], out: Path | IO[bytes], title: str, layers: int = 3) -> Path | IO[bytes]:
    """A PNG of a few layers of a decode step, to a file or a binary stream (the orchestrator's live page)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("a timeline picture needs matplotlib: pip install 'moe-lightning[plot]'") from exc
    step, t0, t1 = decode_window(events, layers)
    shown = [e for e in events if e.end_ns > t0 and e.start_ns < t1 and e.resource in LANES]
    fig, ax = plt.subplots(figsize=(11, 2.8))
    for e in shown:
        lane = LANES.index(e.resource)
        start, width = (max(e.start_ns, t0) - t0) / 1e6, (min(e.end_ns, t1) - max(e.start_ns, t0)) / 1e6
        ax.broken_barh([(start, width)], (lane - 0.4, 0.8), color=COLORS.get(e.stage, "tab:purple"), alpha=0.85)
        if width > (t1 - t0) / 1e6 / 60:  # label boxes wide enough to read
            label = f"L{e.layer}" + (f" m{e.micro_batch}" if e.micro_batch >= 0 else "")
            if e.stage == "group_experts":  # recorded at the group's first micro-batch
                label = f"L{e.layer} group m{e.micro_batch}+"
            ax.text(start + width / 2, lane, label, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(LANES)), LANES)
    ax.set_xlabel("ms")
    ax.set_xlim(0, (t1 - t0) / 1e6)
    ax.set_title(f"{title} (decode step {step}, layers 0-{layers - 1})", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, COLORS.keys(), fontsize=7, loc="upper right", ncol=5)
    fig.tight_layout()
    if isinstance(out, Path):
        out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130, format=None if isinstance(out, Path) else "png")  # a file: its suffix says
    plt.close(fig)
    return out
