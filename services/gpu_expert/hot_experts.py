"""Hot-expert residency: every `interval` decode steps, keep the experts that routing uses most on
the device (the pager swaps pages between steps). Each tensor-parallel rank runs its own: the router
is replicated, so every rank counts the same routing and keeps the same experts."""

from __future__ import annotations

import structlog
from prometheus_client import Counter

from moe_lightning.spec import ModelSpec
from services.gpu_expert.pager import ExpertPager
from services.gpu_expert.residency import plan_residency
from services.gpu_expert.routing import EXPORT_EVERY, RoutingCounts

RESIDENCY_CHANGES = Counter("moe_lightning_residency_changes_total", "Hot-expert residency updates")


class HotExperts:
    def __init__(self, spec: ModelSpec, pager: ExpertPager | None, interval: int, routing: RoutingCounts) -> None:
        self.spec, self.pager, self.interval, self.routing = spec, pager, interval, routing
        self.decode_steps = 0
        self.log = structlog.get_logger()

    def after_decode_step(self) -> None:
        self.decode_steps += 1
        if self.decode_steps % EXPORT_EVERY == 0:
            self.routing.export()
        if self.interval and self.decode_steps % self.interval == 0:
            self.rebalance()

    def rebalance(self) -> None:
        """Between steps: keep the experts that routing uses most resident."""
        pager = self.pager
        if pager is None or pager.plan.max_streamed == 0:
            return
        p = pager.plan
        new = plan_residency(
            self.spec.num_layers,
            self.spec.num_experts,
            p.expert_bytes,
            p.dense_bytes,
            p.budget,
            hot=self.routing.ranking(),
            stream=p.ring_slots > 0,
            dense_layers=self.spec.dense_layers,
        )
        if new.resident != p.resident and new.ring_slots == p.ring_slots:
            moved = sum(len(set(a) ^ set(b)) for a, b in zip(new.resident, p.resident, strict=True)) // 2
            pager.update_residency(new)
            RESIDENCY_CHANGES.inc()
            self.log.info("residency_updated", experts_swapped=moved, after_decode_steps=self.decode_steps)
        self.routing.decay()
