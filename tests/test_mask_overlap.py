"""Grammar masks filled while the step's forward pass runs (issue 54, vLLM's design): the orchestrator
sends a step whose structured-output rows carry `mask_follows` at once, fills their masks after, and
sends them in SetStepMasks; gpu_expert's head waits for them only when it samples. A real runner and
attention worker (runner_pair.py) with its mailbox: masks that come while the step runs constrain their
row alone; masks that never come fault their rows alone after --grammar-mask-timeout; no mailbox entry
outlives its step, failed or not. On the orchestrator's side, the step is sent before its masks are
filled, and a row whose mask cannot be filled is left out and ends alone."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import count
from pathlib import Path

import numpy as np
import pytest
import torch
from fake_backend import FakeBackend
from prometheus_client import REGISTRY
from runner_pair import arena_of, wired

from moe_lightning import grammar as grammar_module
from moe_lightning.arena import weights_from_arena
from moe_lightning.grammar import GrammarSpec
from moe_lightning.logits_processors import mask_words
from moe_lightning.output_text import OutputText
from moe_lightning.request import GenerationRequest
from moe_lightning.sampling import SamplingParams
from moe_lightning.service.errors import ServiceError
from moe_lightning.spec import ModelSpec
from moe_lightning.step_protocol import SequenceWork, StepKind, StepOutput, StepPlan
from moe_lightning.tokenizer import TextTokenizer
from orchestrator.batcher import ScheduledStep, Sequence
from orchestrator.grammars import Grammars
from services.gpu_expert.runner import ExpertRunner

ALLOWED = 42  # the one token the delivered mask allows
PARAMS = [SamplingParams(temperature=1.0, seed=s) for s in (3, 4, 5)]


@pytest.fixture(scope="module")
def runner(tiny_model: Path) -> Iterator[ExpertRunner]:
    spec, arena, layout = arena_of(tiny_model)
    device = torch.device("cpu")
    weights = weights_from_arena(arena, layout, spec, device, experts_on_host=True)
    with wired(spec, weights, device, f"maskovl{os.getpid()}", spec.num_experts, lookahead=False) as (r, _):
        yield r


_ids = count(100)
_steps = count(1)


def plain() -> list[SequenceWork]:
    """New sequences that sample from PARAMS' streams (their tokens depend on the seeds, not the ids)."""
    return [SequenceWork(next(_ids), [5 + i, 7, 9], 0, p) for i, p in enumerate(PARAMS)]


def guided() -> SequenceWork:
    return SequenceWork(next(_ids), [5, 7, 9], 0, SamplingParams(temperature=1.0, seed=9), mask_follows=True)


def only(token: int, vocab: int) -> bytes:
    words = np.zeros(mask_words(vocab), dtype="<u4")
    words[token // 32] = np.uint32(1 << (token % 32))
    return words.tobytes()


def deliveries(arrival: str) -> float:
    return REGISTRY.get_sample_value("moe_lightning_grammar_mask_deliveries_total", {"arrival": arrival}) or 0.0


def tokens_alone(runner: ExpertRunner) -> list[int]:
    return runner.step(StepPlan(next(_steps), [plain()], StepKind.PREFILL)).token_ids


def test_masks_that_arrive_while_the_step_runs_constrain_its_guided_row_alone(runner: ExpertRunner) -> None:
    """The step is running (its id is in gpu_expert's mailbox) before its masks are sent: the guided row
    samples the one token its mask allows, the plain rows beside it get the tokens they get alone."""
    rows, row, step = plain(), guided(), next(_steps)
    during = deliveries("during")
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(runner.step, StepPlan(step, [[*rows, row]], StepKind.PREFILL))
        deadline = time.monotonic() + 60
        while runner.masks.running != step:  # the head waits for the masks: the step stays running
            assert time.monotonic() < deadline and not running.done(), "the step never began"
            time.sleep(0.001)
        runner.masks.deliver(step, {row.seq_id: only(ALLOWED, runner.spec.vocab_size)})
        out = running.result(timeout=120)
    got = dict(zip(out.seq_ids, out.token_ids, strict=True))
    assert not out.faults and got[row.seq_id] == ALLOWED
    assert [got[w.seq_id] for w in rows] == tokens_alone(runner)
    assert deliveries("during") == during + 1
    assert len(runner.masks) == 0


def test_masks_that_never_come_fault_their_rows_alone_and_leave_nothing(runner: ExpertRunner) -> None:
    """No SetStepMasks (the orchestrator died, or its fill raised): after the timeout the guided rows
    fault alone (INTERNAL: not the request's input), the plain ones keep their tokens; a delivery that
    comes after its step is dropped."""
    rows, rows_guided, step = plain(), [guided(), guided()], next(_steps)
    runner.masks.timeout = 0.2
    try:
        out = runner.step(StepPlan(step, [rows + rows_guided], StepKind.PREFILL))
    finally:
        runner.masks.timeout = 30.0
    assert sorted(out.faults) == [w.seq_id for w in rows_guided]
    fault = out.faults[rows_guided[0].seq_id]
    assert not fault.invalid_argument
    assert fault.message.startswith("the token masks of this request's grammar did not reach gpu_expert within 0.2 s")
    got = dict(zip(out.seq_ids, out.token_ids, strict=True))
    assert [got[w.seq_id] for w in rows] == tokens_alone(runner)
    late = deliveries("late")
    runner.masks.deliver(step, {rows_guided[0].seq_id: only(ALLOWED, runner.spec.vocab_size)})
    assert deliveries("late") == late + 1 and len(runner.masks) == 0


def test_no_mailbox_entry_outlives_a_failed_step_or_one_that_never_came(runner: ExpertRunner) -> None:
    """Masks that came early for a step that then fails go with it; those of a step that never reached
    gpu_expert go when the next step begins."""
    step = next(_steps)
    runner.masks.deliver(step, {})  # before its Step call: kept for it
    assert len(runner.masks) == 1
    refused = SequenceWork(next(_ids), [], 0, SamplingParams(), mask_follows=True)  # no tokens: refused
    with pytest.raises(ServiceError, match="has no new tokens"):
        runner.step(StepPlan(step, [[refused]], StepKind.PREFILL))
    assert len(runner.masks) == 0
    runner.masks.deliver(next(_steps), {})  # its step never comes
    assert len(runner.masks) == 1
    tokens_alone(runner)
    assert len(runner.masks) == 0


class _SentBackend(FakeBackend):
    """Records what each step's works carried when the step was sent (the plan's objects move on)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[list[tuple[int, bool, bytes | None]]] = []

    def step(self, plan: StepPlan, fill_masks: Callable[[], dict[int, bytes]] | None = None) -> StepOutput:
        self.sent.append([(w.seq_id, w.mask_follows, w.token_mask) for mb in plan.micro_batches for w in mb])
        return super().step(plan, fill_masks)


def test_the_orchestrator_sends_the_step_before_its_masks_and_leaves_out_a_row_it_cannot_fill(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the overlap on, the plan goes out with its guided rows flagged and no masks in it; the masks
    follow, one per row, the same the old order filled; a row whose fill raised is left out and ends
    alone. With it off (--no-grammar-mask-overlap) the masks travel in the step, as before."""
    spec = ModelSpec.from_pretrained(tiny_model)
    grammars = Grammars(spec, TextTokenizer.from_model_dir(tiny_model))

    def scheduled() -> ScheduledStep:
        seqs = [Sequence(99, GenerationRequest([5, 6, 7], 4), OutputText(GenerationRequest([5, 6, 7], 4), [], None))]
        for i in range(3):
            request = GenerationRequest([5, 6, 7], 4, grammar=GrammarSpec.choice(["yes", "no"]))
            text = OutputText(request, spec.eos_token_ids, None)
            seqs.append(Sequence(i, request, text, grammar=grammars.start(request)))
        works = [SequenceWork(s.seq_id, [5, 6, 7], 0, SamplingParams()) for s in seqs]
        return ScheduledStep(StepPlan(next(_steps), [works], StepKind.PREFILL), seqs)

    backend, ended = _SentBackend(), []
    old = scheduled()
    grammars.run_step(old, backend, False, ended.extend)  # type: ignore[arg-type]
    assert [m is not None for _, follows, m in backend.sent[-1] if not follows] == [False, True, True, True]
    real = grammar_module.fill_bitmask

    def fill(states: list, bitmask: torch.Tensor) -> None:
        if any(s is new.sequences[2].grammar for s in states):
            raise RuntimeError("the mask executor failed")
        real(states, bitmask)

    monkeypatch.setattr(grammar_module, "fill_bitmask", fill)
    new = scheduled()
    grammars.run_step(new, backend, True, ended.extend)  # type: ignore[arg-type]
    assert backend.sent[-1] == [(99, False, None), (0, True, None), (1, True, None), (2, True, None)]
    masks = backend.masks[new.plan.step_id]
    assert sorted(masks) == [0, 2]  # sequence 1 is left out: it ends alone
    assert masks[0] == masks[2] == old.plan.micro_batches[0][1].token_mask
    assert [(s.seq_id, str(e)) for s, e in ended] == [
        (1, "the request's grammar could not compute its next token mask: the mask executor failed")
    ]
