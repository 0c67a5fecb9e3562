"""A decode step's measured timings against the HRM's prediction, per layer, in one fixed set of rows.

The online planner's drift check (orchestrator/planner.py), `bench`'s stage table and
bench/hrm_accuracy.py all read these rows, so a stage means the same thing in all three
(docs/design.md, "Step timings").

What gpu_expert measures (services/gpu_expert/runner.py, clock.py, pager.py): `pre_attention` and
`post_attention` are spans on the device (host time on a CPU device, compute-stream events on CUDA).
Streamed experts are fetched lazily inside post-attention, so the pipelined schedule's waits for
expert pages (`expert_wait`: the host blocking on the copy thread on a CPU device, the compute
stream waiting on the copy's event on CUDA) lie inside `post_attention`. Host-computed experts
(experts placed on the host) run inside `post_attention` too. `attention_wait` is the host
waiting for cpu_attention's reply (its compute plus both hand-offs; with several micro-batches only
the part the device's work on the others did not hide), `attention_busy` cpu_attention's compute as
its replies report it; `device_attention` is attention over gpu_expert's own KV cache. `head` is
once per step; `step` is the whole step inside the runner.

The rows, per layer of a decode step (measured: totals over `steps` decode steps / (steps x L)):

=========== ======================================================== ====================================
row         predicted (cost-model stage_seconds)                     measured (StepTimings)
=========== ======================================================== ====================================
device      gpu_dense + gpu_experts + cpu_experts + link_experts_io  pre_attention + post_attention
            at least gpu_issue (on a CPU device: plus gpu_issue)     - expert_wait
attention   cpu_attention + gpu_attention                            device_attention + attention_busy
head        gpu_head (the model amortises it over the layers)        head
expert_copy gpu_expert_copy + link_weights (the whole copy)          expert_wait (only the exposed part)
layer       Estimate.layer_seconds                                   step
=========== ======================================================== ====================================

The attention row is compute on both sides, never the wait: with several micro-batches the wait is
what the device's work on the others left exposed (near 0 where CGOPipe hides attention), and the
planner, reading it as attention's time, once scaled the host's roofs up 40x and re-planned on that.

So the device row is compute only (bounded by the host's time to issue it, or on a CPU device plus the
calls' fixed cost: hrm/host_issue.py), wherever the experts compute, and the copy is one row of its own
on both sides: its prediction is the whole copy, its measurement what compute waited for (0 when the
copy hid behind compute). A drift in the device row is a wrong compute roof, never a slow link.
The overlap-off baseline (`--no-overlap`) waits for a layer's pages before its pre-attention, outside
both spans: for it the device row reads low by the wait; every comparison here runs the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_lightning.hrm.costmodel import Estimate
from moe_lightning.step_protocol import StepTimings

# row -> the cost-model stages (stage_seconds keys, per layer) it sums; "layer" is layer_seconds
PREDICTED_STAGES: dict[str, tuple[str, ...]] = {
    "device": ("gpu_dense", "gpu_experts", "cpu_experts", "link_experts_io"),
    "attention": ("cpu_attention", "gpu_attention"),
    "head": ("gpu_head",),
    "expert_copy": ("gpu_expert_copy", "link_weights"),
}
LABELS: dict[str, str] = {  # row -> how tables (and the bench's JSON) name it
    "device": "device: dense + experts",
    "attention": "attention",
    "head": "head",
    "expert_copy": "expert copy (exposed wait)",
    "layer": "layer (the step / L)",
}
ROWS = tuple(LABELS)


@dataclass(frozen=True, slots=True)
class Row:
    """Seconds per layer of a decode step."""

    predicted: float
    measured: float

    @property
    def ratio(self) -> float | None:
        """measured / predicted (None when nothing was predicted)."""
        return self.measured / self.predicted if self.predicted else None

    @property
    def error(self) -> float | None:
        """predicted / measured - 1: how far off the prediction is (None when nothing was measured)."""
        return self.predicted / self.measured - 1 if self.measured else None


def predicted_per_layer(est: Estimate) -> dict[str, float]:
    """The cost model's seconds per layer of a decode step, by row."""
    s = est.stage_seconds
    out = {row: sum(s.get(k, 0.0) for k in stages) for row, stages in PREDICTED_STAGES.items()}
    # the host's issue time (gpu_issue) is in the device's spans: they last until the device has run
    # what the host issued, so on a GPU at least the issue time; on a CPU device the same cores run
    # the calls' fixed cost beside the compute
    issue = s.get("gpu_issue", 0.0)
    out["device"] = out["device"] + issue if est.shared_host_device else max(out["device"], issue)
    out["layer"] = est.layer_seconds
    return out


def measured_per_layer(timings: StepTimings, steps: float, layers: int) -> dict[str, float]:
    """Measured seconds per layer of a decode step, by row; {} without steps.
    `timings`: gpu_expert's timings summed over `steps` decode steps (ns)."""
    n = steps * layers
    if n <= 0:
        return {}
    t = timings
    return {
        "device": (t.pre_attention + max(0, t.post_attention - t.expert_wait)) / 1e9 / n,
        "attention": (t.device_attention + t.attention_busy) / 1e9 / n,
        "head": t.head / 1e9 / n,
        "expert_copy": t.expert_wait / 1e9 / n,
        "layer": t.step / 1e9 / n,
    }


def compare(est: Estimate, timings: StepTimings, steps: float, layers: int) -> dict[str, Row]:
    """Predicted vs measured per layer of a decode step, one Row per name in ROWS; {} without steps.
    `est` should be the estimate at the policy that ran (its batch and micro-batch)."""
    measured = measured_per_layer(timings, steps, layers)
    if not measured:
        return {}
    predicted = predicted_per_layer(est)
    return {row: Row(predicted[row], measured[row]) for row in ROWS}


def as_json(rows: dict[str, Row]) -> dict[str, dict[str, float]]:
    """{label: {"predicted": s, "measured": s}}, the benchmarks' JSON."""
    return {LABELS[name]: {"predicted": r.predicted, "measured": r.measured} for name, r in rows.items()}


def table(rows: dict[str, Row], indent: str = "  ") -> list[str]:
    """The rows as text lines: label, predicted ms, measured ms, measured / predicted, error."""
    lines = [f"{indent}{'':32} {'predicted':>9} {'measured':>9} {'meas/pred':>9} {'error':>7}"]
    for name, r in rows.items():
        ratio = f"{r.ratio:9.2f}" if r.ratio is not None else f"{'-':>9}"
        error = f"{r.error:+7.0%}" if r.error is not None else f"{'-':>7}"
        lines.append(f"{indent}{LABELS[name]:32} {1e3 * r.predicted:9.2f} {1e3 * r.measured:9.2f} {ratio} {error}")
    return lines
