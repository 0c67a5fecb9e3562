"""The batcher on its own, driven by a fake backend: admission order, KV waits, cancellation, stop
and length finishes, prefill/decode alternation, and what each plan carries (no processes)."""

from __future__ import annotations

import pytest
from fake_backend import WINDOWED_SPEC, FakeBackend

from moe_lightning.demo_model import build_tokenizer
from moe_lightning.kv_layout import KVLayout
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


def _batcher(blocks: int = 64, block_size: int = 4, **config: int | str) -> Batcher:
    # the tests written for the alternating schedule say so; mixed steps have their own below
    cfg = SchedulerConfig(**{"max_batch_size": 64, "max_queue": 1024, "step_schedule": "alternating", **config})  # type: ignore[arg-type]
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
    b, backend = _batcher(blocks=10, block_size=4, kv_admission="reserve"), FakeBackend()
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
    while b.running or b.queued:
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


def test_every_plan_carries_the_expert_groups_in_force() -> None:
    """The planner's (or the operator's) schedule of a layer's experts reaches gpu_expert with each step,
    and a re-plan's takes effect at the next step."""
    b, backend = _batcher(micro_batch_size=2, expert_groups=2), FakeBackend()
    for _ in range(6):
        _add(b, 3, 4)
    plan, _ = _step(b, backend)
    assert plan.expert_groups == 2
    b.config.expert_groups = 0
    plan, _ = _step(b, backend)
    assert plan.kind is StepKind.DECODE and len(plan.micro_batches) == 3 and plan.expert_groups == 0


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


@pytest.mark.parametrize("windowed", [False, True, "chunked"])
@pytest.mark.parametrize("schedule", ["alternating", "mixed"])
def test_thousands_of_sequences_all_finish_with_every_block_back(schedule: str, windowed: bool | str) -> None:
    """At the operating point's size: 3,000 requests through a cache that holds a third of them, the
    workers' caches mirrored by a real PagedKVCache (an over-committed block fails the step). Windowed:
    a model whose sliding layers free their blocks behind the window (kv_layout.py), the batcher
    counting them back as the mirror frees them; chunked: prompts of up to 40 tokens, in mixed steps fed
    in chunks of a 24-token budget (later chunks start past the window; the batcher credits the blocks
    their sequences freed)."""
    chunked = windowed == "chunked"
    layout = KVLayout.of(WINDOWED_SPEC, 4) if windowed else None
    limits = dict(max_prefill_tokens=40, prefill_budget=24) if chunked else {}
    cfg = SchedulerConfig(max_batch_size=4096, micro_batch_size=128, max_queue=4096, step_schedule=schedule, **limits)
    b = Batcher(KVCapacity(3000, 4, "float32", layout), cfg, Placement(Side.HOST, Side.DEVICE))
    backend = FakeBackend(kv_blocks=3000, block_size=4, **({"spec": WINDOWED_SPEC} if windowed else {}))
    seqs = [_add(b, 1 + i % (40 if chunked else 7), 1 + i % (31 if windowed else 11)) for i in range(3000)]
    released: list[int] = []
    steps = later_chunks = 0
    while b.running or b.queued:
        plan, _ = _step(b, backend)
        released += plan.release
        steps += 1
        later_chunks += sum(1 for mb in plan.micro_batches for w in mb if w.start > 0 and len(w.token_ids) > 1)
        # the same blocks free as in the workers, once they drop what the next plan releases and the
        # batcher counts back what the last step freed behind windows
        kv = backend.kv
        assert kv is not None
        releasing = sum(kv.blocks_of(s) for s in b._release_next)
        # a prompt fed in chunks holds its blocks from admission; the workers take them chunk by chunk
        ahead = [s.blocks - kv.blocks_of(s.seq_id) for s in b.running.values()]
        free = b.free_blocks + b._credit_next
        assert min(ahead, default=0) >= 0 and free == kv.num_free_blocks + releasing - sum(ahead)
    step = b.schedule()  # the last finishes are released by a step of their own
    assert step is not None and step.plan.num_sequences == 0
    released += step.plan.release
    backend.step(step.plan)
    assert b.schedule() is None and b.idle
    assert all(len(s.output) == s.request.max_new_tokens for s in seqs)
    assert sorted(set(released)) == [s.seq_id for s in seqs] and b.free_blocks == 3000
    assert len(released) == 3000 + b.counters.preemptions  # each preemption released the workers' state once
    assert backend.kv.num_free_blocks == 3000 and not backend.kv.tables  # type: ignore[union-attr]
    assert steps < 3000  # batched, not one at a time
    if windowed:  # the sliding group's blocks behind the window were freed while sequences ran
        assert backend.kv.freed_behind_windows > 0  # type: ignore[union-attr]
    if chunked and schedule == "mixed":  # the budget cuts prompts (alternating prefills each whole)
        assert later_chunks > 0


def _run_all(b: Batcher, backend: FakeBackend) -> list[StepPlan]:
    plans = []
    while b.running or b.queued:
        plan, _ = _step(b, backend)
        plans.append(plan)
    return plans


def _outputs(blocks: int, prompts: list[int], max_new: list[int], **config: object) -> tuple[list[list[int]], Batcher]:
    b = _batcher(blocks=blocks, block_size=4, **config)  # type: ignore[arg-type]
    backend = FakeBackend(kv_blocks=blocks, block_size=4)
    seqs = [_add(b, p, n) for p, n in zip(prompts, max_new, strict=True)]
    _run_all(b, backend)
    return [s.output for s in seqs], b


def test_by_need_admits_on_the_prompt_and_preempts_the_newest_when_the_cache_runs_out() -> None:
    b, backend = _batcher(blocks=8, block_size=4), FakeBackend(kv_blocks=8, block_size=4)
    seqs = [_add(b, 4, 12) for _ in range(4)]  # 16 tokens each at the end: 4 blocks; the cache holds 2 of them
    plan, _ = _step(b, backend)
    assert plan.kind is StepKind.PREFILL and plan.num_sequences == 4  # a block each for the prompt: all four in
    assert b.free_blocks == 4 and all(s.blocks == 1 for s in seqs)
    plan, _ = _step(b, backend)  # every decode crosses into a second block: 4 more, still fits
    assert plan.kind is StepKind.DECODE and plan.num_sequences == 4 and b.free_blocks == 0
    for _ in range(3):
        plan, _ = _step(b, backend)
        assert plan.num_sequences == 4 and b.counters.preemptions == 0
    plan, _ = _step(b, backend)  # the next block for each: the newest two make room for the oldest two
    assert b.counters.preemptions == 2 and plan.num_sequences == 2
    assert [w.seq_id for mb in plan.micro_batches for w in mb] == [seqs[0].seq_id, seqs[1].seq_id]
    assert list(b.preempted) == [seqs[2], seqs[3]] and seqs[2].cached == 0 and seqs[2].blocks == 0
    assert len(seqs[2].output) == 5  # what they generated stays theirs
    assert sorted(plan.release) == [seqs[2].seq_id, seqs[3].seq_id]  # the same plan frees them in the workers
    _run_all(b, backend)
    for s in seqs:
        assert len(s.output) == 12
    re_prefills = [w for p in backend.plans for mb in p.micro_batches for w in mb if w.start == 0 and w.seq_id > 2]
    assert len(re_prefills) == 4  # the first prefill of each of the two, and one re-prefill each
    for w in re_prefills[2:]:
        s = seqs[w.seq_id - 1]
        assert w.token_ids == [*s.request.prompt_ids, *s.output[: w.draws]] and w.draws == 5
        assert w.sampling == s.request.sampling  # its stream restarts at draw 5, not 0
    assert b.free_blocks == 8 and b.counters.recomputed_tokens == 2 * 9


@pytest.mark.parametrize("schedule", ["alternating", "mixed"])
def test_preemption_leaves_every_output_as_without_it(schedule: str) -> None:
    """The fake backend's tokens follow each sequence's draws, as a seeded stream or greedy decoding
    does: a cache small enough to preempt often must give the outputs of one that never does, in
    either schedule (mixed steps with a prefill budget that cuts prompts into chunks)."""
    prompts = [1 + (i * 7) % 13 for i in range(60)]
    max_new = [5 + (i * 5) % 23 for i in range(60)]
    roomy, _ = _outputs(2000, prompts, max_new)
    tight, b = _outputs(24, prompts, max_new, max_batch_size=64, step_schedule=schedule, prefill_budget=5)
    reserved, r = _outputs(24, prompts, max_new, kv_admission="reserve", step_schedule=schedule)
    assert b.counters.preemptions > 10 and r.counters.preemptions == 0
    assert tight == roomy and reserved == roomy
    assert b.counters.mean_decode_batch > r.counters.mean_decode_batch  # by need, more run at once


def test_a_re_prefill_longer_than_the_prefill_budget_runs_in_chunks() -> None:
    b = _batcher(blocks=12, block_size=4, max_prefill_tokens=8)
    backend = FakeBackend(kv_blocks=12, block_size=4)
    old, young = _add(b, 8, 40), _add(b, 8, 40)  # 47 tokens cached at most: 12 blocks, the whole cache
    plans = _run_all(b, backend)
    assert len(old.output) == 40 and len(young.output) == 40 and b.counters.preemptions >= 1
    assert old.preemptions == 0  # the oldest is never preempted for a younger one
    chunks = [
        w for p in plans for mb in p.micro_batches for w in mb if w.seq_id == young.seq_id and len(w.token_ids) > 1
    ]
    assert max(len(w.token_ids) for w in chunks) == 8 and any(w.start > 0 for w in chunks)
    assert all(w.draws == chunks[-1].draws for w in chunks if w.start > 0 and w.draws >= 8)
    roomy, _ = _outputs(100, [8, 8], [40, 40], max_prefill_tokens=8)
    assert [old.output, young.output] == roomy


def test_the_oldest_never_starves_behind_a_stream_of_newcomers() -> None:
    b, backend = _batcher(blocks=16, block_size=4), FakeBackend(kv_blocks=16, block_size=4)
    first = _add(b, 4, 40)
    for step in range(400):
        if step % 3 == 0:
            _add(b, 4, 8)
        if not first.finish_reason:
            _step(b, backend)
    assert first.finish_reason == FINISH_LENGTH and first.preemptions == 0


def test_a_failed_step_sends_its_releases_again() -> None:
    """A step that never reached the workers must not lose its releases: a preempted sequence would come
    back (start 0) to a cache still holding its old blocks, and the workers would refuse the step."""
    b, backend = _batcher(blocks=8, block_size=4), FakeBackend(kv_blocks=8, block_size=4)
    seqs = [_add(b, 4, 12) for _ in range(4)]
    failed = None
    while b.running or b.queued:
        before = b.counters.preemptions
        step = b.schedule()
        assert step is not None
        if failed is None and b.counters.preemptions > before:  # the step that preempted: it fails in transit
            failed = step
            b.step_failed(step)
            b.remove([s for s in step.sequences if s.seq_id in b.running])  # what the scheduler's _end does
            continue
        b.update(step, backend.step(step.plan))
    assert failed is not None and set(failed.plan.release) <= {s.seq_id for s in seqs}
    plan = b.schedule()
    if plan is not None:
        backend.step(plan.plan)
    kv = backend.kv
    assert kv is not None and kv.num_free_blocks == 8 and b.free_blocks == 8
    survivors = [s for s in seqs if s.finish_reason is not None]
    assert survivors and all(len(s.output) == 12 for s in survivors)  # the preempted ones came back and finished


def test_preempted_sequences_do_not_fill_the_request_queue() -> None:
    b, backend = _batcher(blocks=8, block_size=4, max_queue=2), FakeBackend(kv_blocks=8, block_size=4)
    for _ in range(2):
        _add(b, 4, 12)
    _step(b, backend)
    for _ in range(2):
        _add(b, 4, 12)
    while not b.preempted:
        _step(b, backend)
    assert len(b.waiting) == 0 and len(b.preempted) >= 1
    _add(b, 4, 12)  # two places in the queue, neither taken by a preempted sequence
    _add(b, 4, 12)
    with pytest.raises(ResourceExhaustedError, match="queue is full"):
        _add(b, 4, 12)


def _mixed(**config: int | str) -> tuple[Batcher, FakeBackend]:
    blocks = int(config.pop("blocks", 256))
    return _batcher(blocks=blocks, block_size=4, step_schedule="mixed", **config), FakeBackend(
        kv_blocks=blocks, block_size=4
    )


def _works(plan: StepPlan) -> list:
    return [w for mb in plan.micro_batches for w in mb]


def test_a_mixed_step_decodes_every_running_sequence_while_it_prefills_the_newcomers() -> None:
    b, backend = _mixed()
    first = [_add(b, 3, 8) for _ in range(3)]
    plan, _ = _step(b, backend)
    assert plan.kind is StepKind.PREFILL and plan.num_sequences == 3  # nothing ran yet: prompts alone
    late = _add(b, 5, 8)
    plan, new = _step(b, backend)
    assert plan.kind is StepKind.MIXED  # the running three decode in the pass that prefills the newcomer
    decodes = [w for w in _works(plan) if w.seq_id != late.seq_id]
    assert [w.seq_id for w in decodes] == [s.seq_id for s in first] and all(len(w.token_ids) == 1 for w in decodes)
    assert [w.token_ids for w in _works(plan) if w.seq_id == late.seq_id] == [[5] * 5]
    assert {t.seq for t in new} == {*first, late}  # everyone got a token from the one pass
    assert all(late not in mb or len(mb) == 1 for mb in plan.micro_batches)  # prompts in micro-batches of their own
    plan, _ = _step(b, backend)
    assert plan.kind is StepKind.DECODE and plan.num_sequences == 4


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks_across_steps() -> None:
    b, backend = _mixed(prefill_budget=4)
    runner = _add(b, 2, 30)
    _step(b, backend)
    long = _add(b, 10, 5)
    chunks = []
    while not long.output:
        plan, _ = _step(b, backend)
        chunks += [(w.start, len(w.token_ids)) for w in _works(plan) if w.seq_id == long.seq_id]
        assert plan.num_tokens - sum(1 for w in _works(plan) if w.seq_id == runner.seq_id) <= 4  # the budget
        assert any(w.seq_id == runner.seq_id for w in _works(plan))  # decode never waits for the prompt
    assert chunks == [(0, 4), (4, 4), (8, 2)] and len(long.output) == 1
    _run_all(b, backend)
    alone, _ = _outputs(256, [2, 10], [30, 5], step_schedule="alternating")
    assert [runner.output, long.output] == alone  # chunked or whole, the same tokens


def test_the_budget_is_shared_oldest_first_and_no_prompt_starves_behind_newcomers() -> None:
    b, backend = _mixed(prefill_budget=6, blocks=4096, max_batch_size=4096)
    long = _add(b, 40, 3)
    steps = 0
    while steps < 60:
        steps += 1
        for _ in range(2):  # a stream of newcomers, more prompt tokens than the budget every step
            _add(b, 5, 3)
        plan, _ = _step(b, backend)
        prefill = [w for w in _works(plan) if len(w.token_ids) > 1 or w.sampling is not None]
        assert sum(len(w.token_ids) for w in prefill) <= 6
        if long.output:
            break
        assert prefill and prefill[0].seq_id == long.seq_id  # the oldest prompt's chunk comes first
    assert long.output and steps == 7  # 40 tokens at 6 a step: 7 steps, however many arrive behind it
