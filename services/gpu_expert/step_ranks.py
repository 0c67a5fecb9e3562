"""How a step runs across ranks: alone on one device, or as one rank of a tensor-parallel group
(docs/parallel.md). Chosen once at start; the step calls the same hooks either way.

In a group every rank prepares the step or refuses it together, the partial sums of o_proj and of
the FFNs are all-reduced (post_attention's `reduce` hook), a failure once the ranks are in the step
breaks the group, and rank 0 gathers each rank's share of the step for the orchestrator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from moe_lightning.stages.post_attention import Reduce
from moe_lightning.step_protocol import RankStep, StepTimings
from services.gpu_expert.ranks import RankGroup, RankGroupError

T = TypeVar("T")


class Alone:
    """One device: no collectives, and no share of the step to report."""

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def together(self, prepare: Callable[[], T]) -> T:
        return prepare()

    def begin_step(self) -> None:
        pass

    def after_failure(self, exc: BaseException, prepared: bool) -> None:
        pass  # the failure is the step's alone

    def finish(self, timings: StepTimings, bytes_streamed: int) -> list[RankStep]:
        return []


class TensorParallel:
    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.reduce: Reduce = group.all_reduce

    def together(self, prepare: Callable[[], T]) -> T:
        return self.group.together(prepare)

    def begin_step(self) -> None:
        self.group.take_collective_ns()  # a rank's wait for this step is not the step's

    def after_failure(self, exc: BaseException, prepared: bool) -> None:
        """Once prepared, every rank is in the step's collectives: one rank's failure leaves the
        others waiting, so the group cannot go on."""
        if prepared and not isinstance(exc, RankGroupError):
            where = f"rank {self.group.shard.rank} failed mid-step"
            raise RankGroupError(f"{where}, the ranks are out of step: {exc}") from exc

    def finish(self, timings: StepTimings, bytes_streamed: int) -> list[RankStep]:
        """Every rank's share of the step, on rank 0 (empty elsewhere)."""
        timings.collectives = self.group.take_collective_ns()
        mine = RankStep(self.group.shard.rank, bytes_streamed, timings.expert_wait, timings.collectives, timings.step)
        return self.group.gather_stats(mine)


def rank_part(group: RankGroup | None) -> Alone | TensorParallel:
    return TensorParallel(group) if group is not None else Alone()
