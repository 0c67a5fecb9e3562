"""The batcher on its own, driven by a fake backend: admission order, KV waits, cancellation, stop
and length finishes, prefill/decode alternation, and what each plan carries (no processes)."""

from __future__ import annotations

import pytest
from fake_backend import FakeBackend

from moe_lightning.demo_model import build_tokenizer
from moe_lightning.output_text import OutputText
from moe_lightning.placement import Placement, Side
from moe_lightning.request import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, GenerationRequest
from moe_lightning.sampling import SamplingParams
from moe_lightning.service.errors import ResourceExhaustedError
from moe_lightning.step_protocol import StepKind, StepPlan
from moe_lightning.tokenizer import TextTokenizer
from orchestrator.backend import KVCapacity
from orchestrator.batcher import FINISH_CANCELLED, Batcher, SchedulerConfig, Sequence

EOS = 2


def _batcher(blocks: int = 64, block_size: int = 4, **config: int) -> Batcher:
    cfg = SchedulerConfig(**{"max_batch_size": 64, "max_queue": 1024, **config})
    return Batcher(KVCapacity(blocks, block_size, "float32"), cfg, Placement(Side.HOST, Side.DEVICE))


def _add(b: Batcher, prompt_len: int, max_new: int, tokenizer: TextTokenizer | None = None, **kw: object) -> Sequence:
    request = GenerationRequest([5] * prompt_len, max_new, SamplingParams(), **kw)  # type: ignore[arg-type]
    return b.add(request, OutputText(request, (EOS,), tokenizer))


def _step(b: Batcher, backend: FakeBackend) -> tuple[StepPlan, list]:
    step = b.schedule()
    assert step is not None
    return step.plan, b.update(step, backend.step(step.plan))


def test_prefill_then_decode_and_new_arrivals_prefill_first() -> None:
    b, backend = _batcher(), FakeBackend()
    first = [_add(b, 3, 5) for _ in range(3)]
    plan, new = _step(b, backend)
    assert plan.kind is StepKind.PREFILL and [w.seq_id for mb in plan.micro_batches for w in mb] == [1, 2, 3]
    assert all(w.start == 0 and w.token_ids == [5, 5, 5] and w.sampling is not None for w in plan.micro_batches[0])
    assert [t.seq for t in new] == first and all(t.finish_reason is None for t in new)
    plan, _ = _step(b, backend)
    assert plan.kind is StepKind.DECODE and plan.num_sequences == 3
    # a decode step feeds back each sequence's last token at its next position; no sampling again
    for w in (w for mb in plan.micro_batches for w in mb):
        seq = b.running[w.seq_id]
        assert w.token_ids == [seq.output[0]] and w.start == 3 and w.sampling is None
    late = _add(b, 2, 5)
    plan, _ = _step(b, backend)  # the newcomer is prefilled alone; the others wait a step
    assert plan.kind is StepKind.PREFILL and [w.seq_id for mb in plan.micro_batches for w in mb] == [late.seq_id]
    plan, _ = _step(b, backend)
    assert plan.kind is StepKind.DECODE and plan.num_sequences == 4
    assert all(p.placement == Placement(Side.HOST, Side.DEVICE) for p in backend.plans)
    assert [p.step_id for p in backend.plans] == [1, 2, 3, 4]


def test_admission_is_first_come_first_served_and_waits_for_kv() -> None:
    b, backend = _batcher(blocks=10, block_size=4), FakeBackend()
    big = [_add(b, 8, 8) for _ in range(3)]  # 16 tokens = 4 blocks each: two fit in 10
    small = _add(b, 1, 3)  # would fit, but must not overtake the third big request
    plan, _ = _step(b, backend)
    assert [w.seq_id for mb in plan.micro_batches for w in mb] == [big[0].seq_id, big[1].seq_id]
    assert b.free_blocks == 2 and list(b.waiting) == [big[2], small]
    for _ in range(7):  # the two finish by length after 8 tokens (1 from the prefill + 7 decodes)
        plan, new = _step(b, backend)
        assert plan.kind is StepKind.DECODE and list(b.waiting) == [big[2], small]
    assert {t.seq for t in new if t.finish_reason == FINISH_LENGTH} == set(big[:2])
    assert b.free_blocks == 10 and not b.running
    plan, _ = _step(b, backend)  # both waiting now fit: admitted together, in arrival order
    assert plan.kind is StepKind.PREFILL
    assert [w.seq_id for mb in plan.micro_batches for w in mb] == [big[2].seq_id, small.seq_id]
    assert sorted(plan.release) == [big[0].seq_id, big[1].seq_id]  # the finished leave through the plan
    assert b.free_blocks == 10 - 4 - 1


def test_finish_reasons_eos_and_length_and_outputs() -> None:
    b = _batcher()
    eos, length, ignore = _add(b, 2, 6), _add(b, 2, 3), _add(b, 2, 3, ignore_eos=True)
    backend = FakeBackend({eos.seq_id: [11, 12, EOS, 13], ignore.seq_id: [EOS, EOS, EOS]})
    reasons = {}
    while b.running or b.waiting:
        _, new = _step(b, backend)
        reasons.update({t.seq.seq_id: t.finish_reason for t in new if t.finish_reason})
    assert reasons == {eos.seq_id: FINISH_EOS, length.seq_id: FINISH_LENGTH, ignore.seq_id: FINISH_LENGTH}
    assert eos.output == [11, 12, EOS] and len(length.output) == 3 and ignore.output == [EOS] * 3
    assert eos.text.final_text is None  # no tokenizer: no text
    assert b.free_blocks == 64


def test_stop_string_finishes_with_the_text_cut_before_it() -> None:
    tokenizer = TextTokenizer(build_tokenizer(400, seed=1))
    text = tokenizer.encode("hello world. the end is near")
    b = _batcher()
    seq = _add(b, 2, 40, tokenizer, stop=("end",))
    backend = FakeBackend({seq.seq_id: text})
    reason = None
    while reason is None:
        _, new = _step(b, backend)
        reason = new[0].finish_reason
    assert reason == FINISH_STOP and len(seq.output) < len(text)
    assert seq.text.final_text == "hello world. the "
    assert not b.running and b.free_blocks == 64


def test_cancellation_of_waiting_and_running_sequences() -> None:
    b, backend = _batcher(max_batch_size=1), FakeBackend()
    running, waiting = _add(b, 2, 9), _add(b, 2, 9)
    _step(b, backend)
    waiting.cancelled = True
    assert b.drop_cancelled() == [waiting] and waiting.finish_reason == FINISH_CANCELLED
    assert not b.waiting and b.free_blocks == 64 - running.blocks
    running.cancelled = True
    assert b.drop_cancelled() == [running] and not b.running and b.free_blocks == 64
    step = b.schedule()  # nothing to run, but the workers still hold the running one's state
    assert step is not None and step.plan.micro_batches == [] and step.sequences == []
    assert step.plan.release == [running.seq_id]  # only admitted sequences hold worker state to drop
    assert b.update(step, backend.step(step.plan)) == [] and b.idle and b.schedule() is None
    again = _add(b, 2, 2)
    plan, _ = _step(b, backend)
    assert plan.release == [] and [w.seq_id for mb in plan.micro_batches for w in mb] == [again.seq_id]


def test_update_skips_sequences_removed_while_the_step_ran() -> None:
    b, backend = _batcher(), FakeBackend()
    a, gone = _add(b, 2, 4), _add(b, 2, 4)
    step = b.schedule()
    assert step is not None
    out = backend.step(step.plan)
    b.remove([gone])  # e.g. a failed request, or one whose waiter went away
    assert [t.seq for t in b.update(step, out)] == [a] and gone.output == []
    plan, _ = _step(b, backend)
    assert plan.release == [gone.seq_id] and plan.num_sequences == 1


def test_batch_size_prefill_budget_and_balanced_decode_micro_batches() -> None:
    b, backend = _batcher(max_batch_size=5, max_prefill_tokens=10, micro_batch_size=2), FakeBackend()
    for n in (4, 4, 4, 1, 1, 1):
        _add(b, n, 20)
    plan, _ = _step(b, backend)  # admission stops once the prompts reach the 10-token budget
    assert [len(mb) for mb in plan.micro_batches] == [2, 1]  # packed: 4 + 4, then 4
    plan, _ = _step(b, backend)
    assert plan.kind is StepKind.PREFILL and plan.num_sequences == 2  # the batch holds at most 5
    plan, _ = _step(b, backend)
    assert plan.kind is StepKind.DECODE and plan.num_sequences == 5 and len(b.waiting) == 1
    assert sorted(len(mb) for mb in plan.micro_batches) == [1, 2, 2]
    contexts = [sum(w.start + 1 for w in mb) for mb in plan.micro_batches]
    assert max(contexts) - min(contexts) <= 6  # balanced by attended context, not by count


def test_queue_limit_and_reset() -> None:
    b = _batcher(max_queue=2)
    _add(b, 1, 1)
    _add(b, 1, 1)
    with pytest.raises(ResourceExhaustedError, match="queue is full"):
        _add(b, 1, 1)
    b.schedule()
    dropped = b.reset(KVCapacity(8, 16, "float32"))
    assert len(dropped) == 2 and not b.running and not b.waiting and b.free_blocks == 8
    plan = b.schedule()
    assert plan is None  # and nothing is released into the new session


def test_thousands_of_sequences_all_finish_with_every_block_back() -> None:
    """At the operating point's size: 3,000 requests through a cache that holds a third of them."""
    b = _batcher(blocks=3000, block_size=4, max_batch_size=4096, micro_batch_size=128, max_queue=4096)
    backend = FakeBackend()
    seqs = [_add(b, 1 + i % 7, 1 + i % 11) for i in range(3000)]
    released: list[int] = []
    steps = 0
    while b.running or b.waiting:
        plan, _ = _step(b, backend)
        released += plan.release
        steps += 1
        assert b.free_blocks >= 0
    step = b.schedule()  # the last finishes are released by a step of their own
    assert step is not None and step.plan.num_sequences == 0
    released += step.plan.release
    assert b.schedule() is None and b.idle
    assert all(len(s.output) == s.request.max_new_tokens for s in seqs)
    assert sorted(released) == [s.seq_id for s in seqs] and b.free_blocks == 3000
    assert steps < 3000  # batched, not one at a time
