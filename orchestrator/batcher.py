"""The batcher: which sequences the next step runs, and what a step's output did to them.

Pure bookkeeping, as nano-vllm's and vLLM's schedulers are: no threads, no clock, no I/O. The
scheduler loop (`scheduler.py`) owns the thread and the backend, and calls `schedule()` -> one
`StepPlan`, runs it, then `update(output)` -> the tokens each sequence got and which finished.

Admission is first come, first served: a request is admitted once the KV blocks for its whole
budget (prompt + max_new_tokens) are free, so a running sequence never finds the cache full. A
step prefills the sequences admitted for it, or, when none were, decodes every running one.
Finished sequences return their blocks at once and are listed in the next plan's `release`.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from moe_lightning.batching import balance
from moe_lightning.output_text import OutputText
from moe_lightning.placement import Placement
from moe_lightning.request import GenerationRequest
from moe_lightning.sampling import TokenLogprobs
from moe_lightning.service.errors import ResourceExhaustedError
from moe_lightning.step_protocol import SequenceWork, StepKind, StepOutput, StepPlan
from moe_lightning.validation import blocks_needed
from orchestrator.backend import KVCapacity

FINISH_CANCELLED = "cancelled"


@dataclass(slots=True)
class SchedulerConfig:
    max_batch_size: int = 64  # the planner's policy sets these unless the operator fixed them
    micro_batch_size: int = 0  # 0: one micro-batch per step
    max_queue: int = 1024
    max_prefill_tokens: int = 8192  # per micro-batch; also the longest prompt accepted


@dataclass(slots=True, eq=False)  # identity: thousands are looked up per step
class Sequence:
    """A request inside the batcher."""

    seq_id: int
    request: GenerationRequest
    text: OutputText  # the generated tokens, when they are done, and their text
    blocks: int  # KV blocks reserved for prompt + max_new_tokens
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    admitted: bool = False
    cancelled: bool = False  # set from any thread; acted on by the next schedule()
    finish_reason: str | None = None  # the text's, or "cancelled"

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def output(self) -> list[int]:
        return self.text.token_ids


@dataclass(slots=True)
class ScheduledStep:
    plan: StepPlan
    sequences: list[Sequence]  # the plan's sequences, in plan order
    admitted: list[Sequence]  # admitted for this step (its prefill)


@dataclass(frozen=True, slots=True)
class NewToken:
    seq: Sequence
    token_id: int
    logprobs: TokenLogprobs | None
    text: str  # what a stream may send now ("" while text that could start a stop string is held)
    finish_reason: str | None  # set when this token ended the sequence


class Batcher:
    def __init__(self, kv: KVCapacity, config: SchedulerConfig, placement: Placement | None = None) -> None:
        self.kv = kv
        self.config = config
        self.placement = placement or Placement()  # sent with every plan
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # by seq id, in admission order
        self.free_blocks = kv.blocks
        self._release_next: list[int] = []
        self._seq_ids = itertools.count(1)
        self._step_ids = itertools.count(1)

    # ---- requests in and out ----------------------------------------------------------------------
    def add(self, request: GenerationRequest, text: OutputText) -> Sequence:
        """Queues a validated request; RESOURCE_EXHAUSTED when the queue is full."""
        if len(self.waiting) >= self.config.max_queue:
            raise ResourceExhaustedError(f"the request queue is full ({self.config.max_queue}); retry later")
        seq = Sequence(next(self._seq_ids), request, text, blocks_needed(request, self.kv.block_size))
        self.waiting.append(seq)
        return seq

    def remove(self, seqs: list[Sequence]) -> None:
        """Takes sequences out (a failed step, a shutdown): their blocks come back, and the next plan
        releases whatever the workers hold for them."""
        gone = {s.seq_id for s in seqs}
        if any(s.seq_id in gone for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if s.seq_id not in gone)
        for seq in seqs:
            if self.running.pop(seq.seq_id, None) is not None:
                self._free(seq)

    def reset(self, kv: KVCapacity) -> list[Sequence]:
        """A new backend session: every sequence is dropped (the workers lost their state) and every
        block is free. Returns the dropped sequences."""
        dropped = [*self.running.values(), *self.waiting]
        self.running.clear()
        self.waiting.clear()
        self.kv = kv
        self.free_blocks = kv.blocks
        self._release_next = []
        return dropped

    @property
    def idle(self) -> bool:
        """Nothing to run and nothing to release."""
        return not self.waiting and not self.running and not self._release_next

    @property
    def kv_usage(self) -> float:
        return 1 - self.free_blocks / self.kv.blocks

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self, on_admit: Callable[[Sequence], None] | None = None) -> ScheduledStep | None:
        """The next step, or None when nothing runs. `on_admit` sees each admitted sequence before
        the next is considered (the planner's workload feedback may change the batch size)."""
        admitted = self._admit(on_admit)
        seqs = admitted or list(self.running.values())
        if not seqs and not self._release_next:
            return None  # (with releases pending, an empty plan drops the workers' state now, not at the next request)
        kind = StepKind.PREFILL if admitted else StepKind.DECODE
        return ScheduledStep(self._plan(seqs, kind), seqs, admitted)

    def update(self, step: ScheduledStep, out: StepOutput) -> list[NewToken]:
        """Appends each sequence's sampled token; the finished leave the running batch."""
        by_seq = dict(zip(out.seq_ids, out.token_ids, strict=True))
        tokens = []
        for seq in step.sequences:
            if seq.seq_id not in by_seq or seq.seq_id not in self.running:
                continue  # removed while the step ran
            token = by_seq[seq.seq_id]
            delta, reason = seq.text.append(token)
            lp = out.logprobs.get(seq.seq_id)
            if lp is not None:
                seq.logprobs.append(lp)
            if reason is not None:
                seq.finish_reason = reason
                del self.running[seq.seq_id]
                self._free(seq)
            tokens.append(NewToken(seq, token, lp, delta, reason))
        return tokens

    # ---- internals ------------------------------------------------------------------------------
    def _free(self, seq: Sequence) -> None:
        if seq.admitted:
            self.free_blocks += seq.blocks
            self._release_next.append(seq.seq_id)

    def drop_cancelled(self) -> list[Sequence]:
        """Takes out the sequences cancelled since the last call (finish_reason "cancelled")."""
        dropped = [s for s in (*self.waiting, *self.running.values()) if s.cancelled]
        for seq in dropped:
            seq.finish_reason = FINISH_CANCELLED
        self.remove(dropped)
        return dropped

    def _admit(self, on_admit: Callable[[Sequence], None] | None) -> list[Sequence]:
        new: list[Sequence] = []
        budget = self.config.max_prefill_tokens
        try:
            while self.waiting and len(self.running) + len(new) < self.config.max_batch_size:
                seq = self.waiting[0]
                if seq.blocks > self.free_blocks:
                    break  # first come, first served: wait for KV to free up
                self.waiting.popleft()
                self.free_blocks -= seq.blocks
                seq.admitted = True
                new.append(seq)
                if on_admit is not None:
                    on_admit(seq)
                budget -= seq.prompt_len
                if budget <= 0:
                    break
        finally:  # should on_admit raise, what was admitted is still accounted for: remove() returns its blocks
            self.running.update((s.seq_id, s) for s in new)
        return new

    def _plan(self, seqs: list[Sequence], kind: StepKind) -> StepPlan:
        if kind is StepKind.PREFILL:
            works = [SequenceWork(s.seq_id, list(s.request.prompt_ids), 0, s.request.sampling) for s in seqs]
            mbs: list[list[SequenceWork]] = []
            tokens = 0  # prompts packed into micro-batches of at most max_prefill_tokens tokens
            for w in works:
                if not mbs or tokens + len(w.token_ids) > self.config.max_prefill_tokens:
                    mbs.append([])
                    tokens = 0
                mbs[-1].append(w)
                tokens += len(w.token_ids)
        elif not seqs:
            mbs = []
        else:  # balanced by context length: micro-batches of equal attention work, no padding
            works = [SequenceWork(s.seq_id, [s.output[-1]], s.prompt_len + len(s.output) - 1) for s in seqs]
            size = self.config.micro_batch_size or len(works)
            contexts = [w.start + 1 for w in works]
            mbs = [[works[i] for i in group] for group in balance(contexts, -(-len(works) // size))]
        release, self._release_next = self._release_next, []
        return StepPlan(next(self._step_ids), mbs, kind, release, self.placement)
