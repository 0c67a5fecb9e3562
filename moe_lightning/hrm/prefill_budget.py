"""How many prompt tokens a mixed step takes on beside its decodes (orchestrator/batcher.py).

When the link binds, a step costs one pass of the streamed expert weights whatever it computes: prompt
tokens ride in that pass for free until the device's or the host's time reaches the link's. A prompt
token costs the device what a decode token does (its dense GEMMs and its share of the experts) and the
host at most what a decode token's attention does (a chunk attends to its own, shorter, prefix), so
the budget is N (t_link / t_busiest - 1) for N decodes. When the link does not bind, every token costs
time and the fewest passes per prompt win: the largest chunk (MoE-Lens, arXiv 2504.09345; docs/hrm.md).
"""

from __future__ import annotations

from moe_lightning.hrm.costmodel import Estimate


def prefill_budget(est: Estimate, cap: int) -> int:
    """Prompt tokens per mixed step for the plan `est`, in 1..cap."""
    t = est.resource_seconds
    busiest = max(t["gpu"], t["cpu"])
    if est.binding != "link" or busiest <= 0:
        return cap
    return max(1, min(cap, int(est.policy.batch * (t["link"] / busiest - 1))))
