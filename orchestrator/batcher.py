"""The batcher: which sequences the next step runs, and what a step's output did to them.

Pure bookkeeping, as nano-vllm's and vLLM's schedulers are: no threads, no clock, no I/O. The
scheduler loop (`scheduler.py`) owns the thread and the backend, and calls `schedule()` -> one
`StepPlan`, runs it, then `update(output)` -> the tokens each sequence got and which finished.

Admission is first come, first served. By default (`kv_admission="need"`, docs/kv-cache.md) a
sequence takes KV blocks as it grows: its prompt's at admission, one more each time a decode crosses
a block. When a step's growth does not fit, the most recently arrived running sequences are
preempted: their blocks are freed (the next plan releases them in the workers), and they go back to
the front of the queue to be re-prefilled, prompt and generated tokens together, once blocks free
up; the re-prefill's sampled token is their next, drawn at the same place in their random stream.
`kv_admission="reserve"` keeps the older rule: the blocks of prompt + max_new_tokens are taken at
admission, so nothing is ever preempted and fewer sequences run.

What a step runs (`step_schedule`): "mixed" (the default) decodes every running sequence and, in
the same weight pass, prefills prompts in chunks within `prefill_budget` tokens (the HRM's:
hrm/prefill_budget.py): the rest of prompts already begun and re-prefills first, oldest first, then
new ones, so no prompt starves behind newcomers and a long one spans steps. "alternating" (the
paper's) prefills the sequences admitted for a step or, when none were, decodes every running one.
Finished sequences return their blocks at once and are listed in the next plan's `release`.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from moe_lightning.batching import balance
from moe_lightning.config.choices import KV_ADMISSIONS, STEP_SCHEDULES
from moe_lightning.output_text import OutputText
from moe_lightning.placement import Placement
from moe_lightning.request import GenerationRequest
from moe_lightning.sampling import PromptLogprobs, TokenLogprobs
from moe_lightning.service.errors import ResourceExhaustedError
from moe_lightning.step_protocol import SequenceWork, StepKind, StepOutput, StepPlan
from moe_lightning.validation import blocks_needed
from orchestrator.backend import KVCapacity

if TYPE_CHECKING:
    from moe_lightning.grammar import GrammarState

FINISH_CANCELLED = "cancelled"
# free blocks kept back at admission while anything runs (vLLM's watermark): a cache filled to the last
# block by new prompts would preempt on the very next decode step
WATERMARK = 0.01


@dataclass(slots=True)
class SchedulerConfig:
    max_batch_size: int = 64  # the planner's policy sets these unless the operator fixed them
    micro_batch_size: int = 0  # 0: one micro-batch per step
    max_queue: int = 1024
    max_prefill_tokens: int = 8192  # per micro-batch; also the longest prompt accepted
    kv_admission: str = KV_ADMISSIONS[0]  # need or reserve: see the module docstring
    step_schedule: str = STEP_SCHEDULES[0]  # mixed or alternating: see the module docstring
    prefill_budget: int = 0  # prompt tokens a mixed step takes on (0: max_prefill_tokens); the planner's
    expert_groups: int = 0  # groups of micro-batches whose layer FFN runs at once (0: per micro-batch); the planner's
    mask_overlap: bool = True  # grammar masks filled while the step runs (orchestrator/grammars.py), not before


@dataclass(slots=True, eq=False)  # identity: thousands are looked up per step
class Sequence:
    """A request inside the batcher."""

    seq_id: int
    request: GenerationRequest
    text: OutputText  # the generated tokens, when they are done, and their text
    blocks: int = 0  # KV blocks it holds now (in the workers' caches)
    cached: int = 0  # its tokens in the KV cache once the step scheduled last has run
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # with prompt_logprobs: one entry per prompt token from the second on, filled as its chunks run
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    grammar: GrammarState | None = None  # structured output: the grammar's state after its output so far
    admitted: bool = False
    preemptions: int = 0
    # its last step was a chunk short of its end, whose sampled token it did not keep: the workers'
    # stream for it moved on, so the next step carries its place (`draws`) again
    stream_ahead: bool = False
    cancelled: bool = False  # set from any thread; acted on by the next schedule()
    finish_reason: str | None = None  # the text's, or "cancelled"

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def output(self) -> list[int]:
        return self.text.token_ids

    @property
    def length(self) -> int:
        """Prompt and generated tokens."""
        return self.prompt_len + len(self.output)

    @property
    def decoding(self) -> bool:
        """Everything but its last token is cached: the next step feeds that one."""
        return self.cached == self.length - 1


@dataclass(slots=True)
class ScheduledStep:
    plan: StepPlan
    sequences: list[Sequence]  # the plan's sequences
    decodes: int = 0  # of them, those that decode (one token each)


@dataclass(frozen=True, slots=True)
class NewToken:
    seq: Sequence
    token_id: int
    logprobs: TokenLogprobs | None
    text: str  # what a stream may send now ("" while text that could start a stop string is held)
    finish_reason: str | None  # set when this token ended the sequence


@dataclass(slots=True)
class BatcherCounters:
    """Totals since start, for the metrics and a job's summary."""

    preemptions: int = 0
    recomputed_tokens: int = 0  # tokens re-prefilled after preemptions
    decode_steps: int = 0
    decode_sequences: int = 0  # summed over decode steps: / decode_steps = the mean decode batch

    @property
    def mean_decode_batch(self) -> float:
        return self.decode_sequences / self.decode_steps if self.decode_steps else 0.0


class Batcher:
    def __init__(self, kv: KVCapacity, config: SchedulerConfig, placement: Placement | None = None) -> None:
        if config.kv_admission not in KV_ADMISSIONS:
            raise ValueError(f"kv_admission must be one of {', '.join(KV_ADMISSIONS)}; got {config.kv_admission!r}")
        self.kv = kv
        self.config = config
        self.placement = placement or Placement()  # sent with every plan
        self.waiting: deque[Sequence] = deque()  # never admitted yet; --max-queue bounds these alone
        self.preempted: deque[Sequence] = deque()  # admitted before waiting ones, oldest first
        self.running: dict[int, Sequence] = {}  # by seq id, in admission order
        self.free_blocks = kv.blocks
        self._credit_next = 0  # blocks freed behind sliding windows by the step planned last (_feed)
        self.counters = BatcherCounters()
        self._release_next: list[int] = []
        self._seq_ids = itertools.count(1)
        self._step_ids = itertools.count(1)

    # ---- requests in and out ----------------------------------------------------------------------
    def add(self, request: GenerationRequest, text: OutputText) -> Sequence:
        """Queues a validated request; RESOURCE_EXHAUSTED when the queue is full."""
        if len(self.waiting) >= self.config.max_queue:
            raise ResourceExhaustedError(f"the request queue is full ({self.config.max_queue}); retry later")
        seeded = request.sampling.with_seed()  # its stream must survive a preemption (sampling.py)
        if seeded is not request.sampling:
            request = replace(request, sampling=seeded)
        seq = Sequence(next(self._seq_ids), request, text)
        self.waiting.append(seq)
        return seq

    def remove(self, seqs: list[Sequence]) -> None:
        """Takes sequences out (a failed step, a shutdown): their blocks come back, and the next plan
        releases whatever the workers hold for them."""
        gone = {s.seq_id for s in seqs}
        if any(s.seq_id in gone for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if s.seq_id not in gone)
        if any(s.seq_id in gone for s in self.preempted):
            self.preempted = deque(s for s in self.preempted if s.seq_id not in gone)
        for seq in seqs:
            if self.running.pop(seq.seq_id, None) is not None:
                self._free(seq)

    def reset(self, kv: KVCapacity) -> list[Sequence]:
        """A new backend session: every sequence is dropped (the workers lost their state) and every
        block is free. Returns the dropped sequences."""
        dropped = [*self.running.values(), *self.preempted, *self.waiting]
        self.running.clear()
        self.preempted.clear()
        self.waiting.clear()
        self.kv = kv
        self.free_blocks = kv.blocks
        self._credit_next = 0
        self._release_next = []
        return dropped

    @property
    def idle(self) -> bool:
        """Nothing to run and nothing to release."""
        return not self.queued and not self.running and not self._release_next

    @property
    def queued(self) -> list[Sequence]:
        """Every sequence not running, in admission order: the preempted, then the waiting."""
        return [*self.preempted, *self.waiting]

    @property
    def kv_usage(self) -> float:
        return 1 - self.free_blocks / self.kv.blocks

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self, on_admit: Callable[[Sequence], None] | None = None) -> ScheduledStep | None:
        """The next step, or None when nothing runs. `on_admit` sees each sequence at its first
        admission, before the next is considered (the planner's workload feedback may change the
        batch size)."""
        self.free_blocks += self._credit_next  # the step planned last has run: the workers freed them
        self._credit_next = 0
        if self.config.step_schedule == "alternating":
            return self._alternating(on_admit)
        return self._mixed(on_admit)

    def _alternating(self, on_admit: Callable[[Sequence], None] | None) -> ScheduledStep | None:
        """A step prefills (whole prompts; re-prefills in chunks) or decodes, never both: the paper's."""
        # re-prefills that span steps: their blocks were taken at admission, so they never preempt
        resuming = [s for s in self.running.values() if not s.decoding]
        admitted = self._admit(on_admit, self.config.max_prefill_tokens) if not resuming else []
        if resuming or admitted:
            prefill = [self._prefill_work(s, self.config.max_prefill_tokens) for s in resuming + admitted]
            return self._step([], prefill, resuming + admitted)
        works, seqs = self._decode_works()
        return self._step(works, [], seqs)

    def _mixed(self, on_admit: Callable[[Sequence], None] | None) -> ScheduledStep | None:
        """Every running sequence decodes, and prompts (the rest of long ones and re-prefills first,
        oldest first, then new ones) fill the step's prefill budget in chunks: one weight pass serves
        both, and a newcomer never costs a pass of its own (docs/cgopipe-and-benchmarks.md)."""
        resuming = sorted((s for s in self.running.values() if not s.decoding), key=lambda s: s.seq_id)
        works, seqs = self._decode_works()  # (may preempt some of those)
        budget = self.config.prefill_budget or self.config.max_prefill_tokens
        prefill: list[SequenceWork] = []
        for s in resuming:
            if budget <= 0:
                break
            if s.seq_id not in self.running:
                continue
            prefill.append(self._prefill_work(s, min(budget, self.config.max_prefill_tokens)))
            seqs.append(s)
            budget -= len(prefill[-1].token_ids)
        for s in self._admit(on_admit, budget) if budget > 0 else []:
            prefill.append(self._prefill_work(s, min(budget, self.config.max_prefill_tokens)))
            seqs.append(s)
            budget -= len(prefill[-1].token_ids)
        return self._step(works, prefill, seqs)

    def update(
        self, step: ScheduledStep, out: StepOutput, on_fault: Callable[[Sequence, Exception], None] | None = None
    ) -> list[NewToken]:
        """Appends each sequence's sampled token; the finished leave the running batch. A chunk of a
        re-prefill that does not reach the sequence's end samples nothing it keeps. A sequence whose
        output raised (its detokenizer, its stop strings, its prompt's log-probabilities) is taken out
        and handed to `on_fault` (None: raised), and the others keep their tokens (issue 54)."""
        by_seq = dict(zip(out.seq_ids, out.token_ids, strict=True))
        tokens = []
        for seq in step.sequences:
            try:
                new = self._take(seq, by_seq, out)
            except Exception as exc:
                if on_fault is None:
                    raise
                self.remove([seq])
                on_fault(seq, exc)
                continue
            if new is not None:
                tokens.append(new)
        return tokens

    def _take(self, seq: Sequence, by_seq: dict[int, int], out: StepOutput) -> NewToken | None:
        """What the step gave one sequence: its prompt entries, then its token when it keeps one."""
        if seq.seq_id not in self.running:
            return None  # removed (a fault, a cancel) or preempted while the step ran
        chunk = out.prompt_logprobs.get(seq.seq_id)
        if chunk is not None:
            _merge_prompt_logprobs(seq, chunk)
        if seq.seq_id not in by_seq or seq.cached != seq.length:
            return None  # a chunk short of its end
        token = by_seq[seq.seq_id]
        delta, reason = seq.text.append(token)
        lp = out.logprobs.get(seq.seq_id)
        if lp is not None:
            seq.logprobs.append(lp)
        if reason is not None:
            seq.finish_reason = reason
            del self.running[seq.seq_id]
            self._free(seq)
        return NewToken(seq, token, lp, delta, reason)

    def step_failed(self, step: ScheduledStep) -> None:
        """A step that failed may not have reached the workers: the releases it carried go with the next
        plan again (releasing what a worker no longer holds is a no-op), else a preempted sequence would
        come back to a cache that still holds its old blocks."""
        again = [s for s in step.plan.release if s not in self._release_next]
        self._release_next = [*again, *self._release_next]

    def drop_cancelled(self) -> list[Sequence]:
        """Takes out the sequences cancelled since the last call (finish_reason "cancelled")."""
        dropped = [s for s in (*self.queued, *self.running.values()) if s.cancelled]
        for seq in dropped:
            seq.finish_reason = FINISH_CANCELLED
        self.remove(dropped)
        return dropped

    # ---- internals ------------------------------------------------------------------------------
    def _free(self, seq: Sequence) -> None:
        if seq.admitted:
            self.free_blocks += seq.blocks
            seq.blocks, seq.admitted = 0, False
            self._release_next.append(seq.seq_id)

    def _growth(self, seq: Sequence, feed: int) -> int:
        """Blocks `seq` takes for its next `feed` tokens (at most): none while its reservation lasts."""
        end = seq.cached + min(feed, seq.length - seq.cached)
        return max(0, self.kv.layout.blocks_held(seq.cached, end) - seq.blocks)

    def _make_room(self, seqs: list[Sequence], feed: int) -> None:
        """Preempts the most recently arrived running sequences until the next `feed` tokens of each
        of `seqs` still running fit. The oldest is never preempted for a younger one, so it always
        progresses (check_kv let in only what fits the cache alone)."""
        need = sum(self._growth(s, feed) for s in seqs)
        while need > self.free_blocks:
            victim = self.running[max(self.running)]
            if victim in seqs:
                need -= self._growth(victim, feed)
            self._preempt(victim)

    def _preempt(self, seq: Sequence) -> None:
        del self.running[seq.seq_id]
        self._free(seq)
        seq.cached = 0
        seq.preemptions += 1
        self.counters.preemptions += 1
        self.preempted.appendleft(seq)  # the newest first: the oldest preempted ends up at the front

    def _admission_blocks(self, seq: Sequence) -> int:
        if self.config.kv_admission == "reserve":
            return blocks_needed(seq.request, self.kv.layout)
        # all its tokens, even when its re-prefill spans steps: a chunk that had to preempt for the next
        # would preempt itself, and the older sequences would wait on it for good
        return self.kv.layout.blocks_for(seq.length)

    def _admit(self, on_admit: Callable[[Sequence], None] | None, budget: int) -> list[Sequence]:
        """First come, first served, while the batch has room, the KV cache the blocks and the step
        `budget` prompt tokens (the last one admitted may take fewer than its prompt, in mixed steps)."""
        new: list[Sequence] = []
        watermark = 0 if self.config.kv_admission == "reserve" else math.ceil(WATERMARK * self.kv.blocks)
        try:
            while len(self.running) + len(new) < self.config.max_batch_size:
                queue = self.preempted or self.waiting
                if not queue:
                    break
                seq = queue[0]
                blocks = self._admission_blocks(seq)
                running = len(self.running) + len(new)
                # a preempted sequence comes back once every running one has a block to grow into: else it
                # would be preempted again within a few steps, its whole re-prefill spent on them
                reserve = max(watermark, running) if seq.preemptions else watermark
                if blocks > self.free_blocks - (reserve if running else 0):
                    break  # first come, first served: wait for KV to free up
                queue.popleft()
                self.free_blocks -= blocks
                seq.blocks, seq.admitted = blocks, True
                new.append(seq)
                if seq.preemptions:
                    self.counters.recomputed_tokens += seq.length
                elif on_admit is not None:
                    on_admit(seq)
                budget -= min(seq.length, self.config.max_prefill_tokens)
                if budget <= 0:
                    break
        finally:  # should on_admit raise, what was admitted is still accounted for: remove() returns its blocks
            self.running.update((s.seq_id, s) for s in new)
        return new

    def _feed(self, seq: Sequence, tokens: int) -> tuple[list[int], int]:
        """The next `tokens` (at most) of `seq` to compute, and where they start; the batcher's view of
        its cache grows by them (the step that computes them was just planned)."""
        start = seq.cached
        end = min(seq.length, start + tokens)
        held = self.kv.layout.blocks_held(start, end)
        grow = held - seq.blocks
        if grow > 0:
            self.free_blocks -= grow
            seq.blocks += grow
        elif grow < 0 and end == seq.length and self.config.kv_admission != "reserve":
            # its blocks behind a sliding window (kv_layout.py), freed as the workers begin this step:
            # others may take them from the next step on (a micro-batch of this one may run before
            # the one that frees them). Not before its prefill is done: its admission took them all.
            seq.blocks = held
            self._credit_next -= grow
        seq.cached = end
        seq.stream_ahead = end < seq.length
        if seq.output and start == seq.length - 1:  # a decode: the last sampled token
            return [seq.output[-1]], start
        prompt = seq.request.prompt_ids
        return list(prompt[start:end] if end <= len(prompt) else [*prompt, *seq.output][start:end]), start

    def _prefill_work(self, s: Sequence, tokens: int) -> SequenceWork:
        ids, start = self._feed(s, tokens)
        # every chunk carries the sampling parameters: the workers (re)start its stream at `draws`
        return SequenceWork(s.seq_id, ids, start, s.request.sampling, len(s.output), s.prompt_len)

    def _decode_works(self) -> tuple[list[SequenceWork], list[Sequence]]:
        """A token for every running sequence that decodes, the newest preempted first if the cache
        cannot take their growth."""
        decoding = [s for s in self.running.values() if s.decoding]
        if decoding:
            self._make_room(decoding, 1)
        seqs = [s for s in self.running.values() if s.decoding]
        works = []
        for s in seqs:
            sampling = s.request.sampling if s.stream_ahead else None  # (before _feed clears it)
            draws = len(s.output) if sampling else 0
            works.append(SequenceWork(s.seq_id, *self._feed(s, 1), sampling, draws, s.prompt_len if sampling else 0))
        return works, seqs

    def _step(
        self, decode: list[SequenceWork], prefill: list[SequenceWork], seqs: list[Sequence]
    ) -> ScheduledStep | None:
        """The plan of these works: decodes in micro-batches balanced by context (equal attention work,
        no padding), prompts packed into micro-batches of at most max_prefill_tokens tokens."""
        if not decode and not prefill and not self._release_next:
            return None  # (with releases pending, an empty plan drops the workers' state now, not at the next request)
        mbs: list[list[SequenceWork]] = []
        if decode:
            size = self.config.micro_batch_size or len(decode)
            contexts = [w.start + 1 for w in decode]
            mbs = [[decode[i] for i in group] for group in balance(contexts, -(-len(decode) // size))]
            self.counters.decode_steps += 1
            self.counters.decode_sequences += len(decode)
        tokens = 0
        for i, w in enumerate(prefill):
            if i == 0 or tokens + len(w.token_ids) > self.config.max_prefill_tokens:
                mbs.append([])
                tokens = 0
            mbs[-1].append(w)
            tokens += len(w.token_ids)
        kind = StepKind.MIXED if decode and prefill else StepKind.PREFILL if prefill else StepKind.DECODE
        return ScheduledStep(self._plan(mbs, kind, len(decode)), seqs, len(decode))

    def _plan(self, mbs: list[list[SequenceWork]], kind: StepKind, decodes: int) -> StepPlan:
        release, self._release_next = self._release_next, []
        return StepPlan(next(self._step_ids), mbs, kind, release, self.placement, self.config.expert_groups, decodes)


def _merge_prompt_logprobs(seq: Sequence, chunk: PromptLogprobs) -> None:
    """Appends a chunk's prompt entries in position order; a re-prefill after a preemption computes
    entries the sequence has already, which are dropped."""
    have = len(seq.prompt_logprobs) + 1  # the position of the next entry (position 0 has none)
    skip = have - chunk.first_position
    if skip >= 0:
        seq.prompt_logprobs.extend(chunk.entries[skip:])
