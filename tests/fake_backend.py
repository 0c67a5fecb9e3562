"""A stand-in for gpu_expert's Step that the scheduler's unit tests drive (no processes)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.placement import Placement
from moe_lightning.spec import ModelSpec
from moe_lightning.step_protocol import SequenceFault, StepOutput, StepPlan, StepTimings
from orchestrator.backend import KVCapacity
from orchestrator.scheduler import Scheduler, SchedulerConfig

# the smallest K/V a PagedKVCache can hold: the mirror below keeps its block tables, not its values
_MIRROR_SPEC = ModelSpec("MixtralForCausalLM", 8, 16, 1, 2, 1, 2, 2, 1, 400)
# GPT-OSS's pattern: every other layer within a window (of 6 here), so the mirror frees blocks behind it
WINDOWED_SPEC = ModelSpec("MixtralForCausalLM", 8, 16, 2, 2, 1, 2, 2, 1, 400, sliding_window=6, sliding_layers=(0,))


class FakeBackend:
    """Answers a plan as gpu_expert would, with scripted tokens: sequence s's i-th generated token is
    `script[s][i]` when scripted, else a token that is never EOS; i counts from the `draws` a step with
    sampling parameters carries, as gpu_expert's random stream does, so a re-prefilled sequence gets the
    tokens it would have. `faults` (seq id -> fault) reports a sequence the head could not sample, the
    first step it is in. Records every plan. `fail` makes the next step raise it, `down` every step; while `gate` is
    clear, steps wait for it (a step in flight). With `kv_blocks`, a real PagedKVCache mirrors what the
    workers' caches do with each plan (release, then each sequence's new tokens at its start): a
    batcher that over-commits the cache or disagrees on a length fails the step, as the workers would."""

    def __init__(
        self,
        script: dict[int, list[int]] | None = None,
        kv_blocks: int = 0,
        block_size: int = 16,
        spec: ModelSpec = _MIRROR_SPEC,
    ) -> None:
        """`spec`: the model the mirrored cache lays its blocks out for (its sliding windows)."""
        self.script = script or {}
        self.kv = PagedKVCache(spec, kv_blocks, block_size) if kv_blocks else None
        self.plans: list[StepPlan] = []
        self.generated: dict[int, int] = {}
        self.faults: dict[int, SequenceFault] = {}
        self.fail: BaseException | None = None
        self.down: BaseException | None = None  # raised by every step while set (a dead worker)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # set when a step has begun
        self.masks: dict[int, dict[int, bytes]] = {}  # step id -> the masks that followed it

    def step(self, plan: StepPlan, fill_masks: Callable[[], dict[int, bytes]] | None = None) -> StepOutput:
        self.plans.append(plan)
        self.entered.set()
        if fill_masks is not None:  # as the real backend does: once the step is sent
            self.masks[plan.step_id] = fill_masks()
        self.gate.wait(30)
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        if self.down is not None:
            raise self.down
        if self.kv is not None:
            for seq in plan.release:
                self.kv.free(seq)
            for mb in plan.micro_batches:
                self.kv.begin([w.seq_id for w in mb], [len(w.token_ids) for w in mb], [w.start for w in mb])
        seq_ids, tokens, faults = [], [], {}
        for mb in plan.micro_batches:
            for w in mb:
                if w.sampling is not None:
                    self.generated[w.seq_id] = w.draws
                i = self.generated.get(w.seq_id, 0)
                self.generated[w.seq_id] = i + 1
                script = self.script.get(w.seq_id)
                seq_ids.append(w.seq_id)
                if w.seq_id in self.faults:
                    faults[w.seq_id] = self.faults.pop(w.seq_id)
                tokens.append(script[i] if script and i < len(script) else 10 + (w.seq_id + i) % 50)
        return StepOutput(seq_ids, tokens, StepTimings(plan.kind), faults=faults)


# the workers' cache as the scheduler tests' loops see it: 256 blocks of 4 tokens
FAKE_KV = KVCapacity(256, 4, "float32")


def scheduler_on_fake(model_dir: Path, planner: object = None) -> tuple[Scheduler, FakeBackend]:
    """A started Scheduler of the model in `model_dir` on a FakeBackend with FAKE_KV's cache."""
    backend = FakeBackend()
    s = Scheduler(ModelSpec.from_pretrained(model_dir), backend, None, FAKE_KV, SchedulerConfig(), planner, Placement())  # type: ignore[arg-type]
    s.start()
    return s, backend


@contextmanager
def running_scheduler(model_dir: Path) -> Iterator[tuple[Scheduler, FakeBackend]]:
    """scheduler_on_fake's pair, stopped after (a step held at the gate let go first)."""
    s, backend = scheduler_on_fake(model_dir)
    try:
        yield s, backend
    finally:
        backend.gate.set()
        s.stop()
