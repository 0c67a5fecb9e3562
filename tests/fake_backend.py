"""A stand-in for gpu_expert's Step that the scheduler's unit tests drive (no processes)."""

from __future__ import annotations

import threading

from moe_lightning.step_protocol import StepOutput, StepPlan, StepTimings


class FakeBackend:
    """Answers a plan as gpu_expert would, with scripted tokens: sequence s's i-th generated token is
    `script[s][i]` when scripted, else a token that is never EOS. Records every plan. `fail` makes the
    next step raise it; while `gate` is clear, steps wait for it (a step in flight)."""

    def __init__(self, script: dict[int, list[int]] | None = None) -> None:
        self.script = script or {}
        self.plans: list[StepPlan] = []
        self.generated: dict[int, int] = {}
        self.fail: BaseException | None = None
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # set when a step has begun

    def step(self, plan: StepPlan) -> StepOutput:
        self.plans.append(plan)
        self.entered.set()
        self.gate.wait(30)
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        seq_ids, tokens = [], []
        for mb in plan.micro_batches:
            for w in mb:
                i = self.generated.get(w.seq_id, 0)
                self.generated[w.seq_id] = i + 1
                script = self.script.get(w.seq_id)
                seq_ids.append(w.seq_id)
                tokens.append(script[i] if script and i < len(script) else 10 + (w.seq_id + i) % 50)
        return StepOutput(seq_ids, tokens, StepTimings(plan.kind))
