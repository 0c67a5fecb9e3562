"""The request queue and the batcher: admits requests as KV capacity allows, and drives each step.

One thread owns the running batch. Each iteration either prefills newly admitted requests or runs
one decode step for all running ones; tokens go back to their waiters (unary, stream or batch) as
soon as the step returns. KV blocks are reserved for a request's whole budget at admission, so a
running request never finds the cache full.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog

from moe_lightning.batching import balance
from moe_lightning.hrm.costmodel import Policy
from moe_lightning.placement import Placement
from moe_lightning.plan import SequenceWork, StepKind, StepOutput, StepPlan
from moe_lightning.request import GenerationRequest, GenerationResult, InvalidRequestError
from moe_lightning.sampling import TokenLogprobs
from moe_lightning.service.errors import (
    ResourceExhaustedError,
    ServiceError,
    ShuttingDownError,
    UnavailableError,
    status_for,
)
from moe_lightning.spec import ModelSpec
from moe_lightning.stopping import StopChecker
from moe_lightning.tokenizer import TextTokenizer
from orchestrator import metrics
from orchestrator.backend import Backend, KVCapacity
from orchestrator.planner import Planner

# (new token ids, their log-probabilities when the request asked for them, else [])
TokenCallback = Callable[[list[int], list[TokenLogprobs]], None]


@dataclass(slots=True)
class Ticket:
    """A request's life in the scheduler, and how its waiter hears about it."""

    request: GenerationRequest
    checker: StopChecker
    seq_id: int
    blocks: int
    on_tokens: TokenCallback | None = None
    arrival: float = field(default_factory=time.monotonic)
    admitted: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prefilled: bool = False
    cancelled: bool = False
    result: GenerationResult | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def wait(self, timeout: float | None = None) -> GenerationResult:
        if not self.done.wait(timeout):
            raise TimeoutError("request did not finish in time")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


@dataclass(slots=True)
class SchedulerConfig:
    max_batch_size: int = 64  # the planner's policy sets these unless the operator fixed them
    micro_batch_size: int = 0  # 0: one micro-batch per step
    max_queue: int = 1024
    max_prefill_tokens: int = 8192  # per micro-batch; also the longest prompt accepted


class Scheduler:
    def __init__(
        self,
        spec: ModelSpec,
        backend: Backend,
        tokenizer: TextTokenizer | None,
        kv: KVCapacity,
        config: SchedulerConfig,
        planner: Planner | None = None,
        placement: Placement | None = None,
    ) -> None:
        self.spec = spec
        self.backend = backend
        self.tokenizer = tokenizer
        self.kv_blocks = kv.blocks
        self.block_size = kv.block_size
        self.config = config
        self.planner = planner
        self.placement = placement or Placement()  # sent with every step
        self.log = structlog.get_logger()
        self._waiting: deque[Ticket] = deque()
        self._running: list[Ticket] = []
        self._free_blocks = kv.blocks
        self._cv = threading.Condition()
        self._stopping = False
        self._closed = False
        self._seq_ids = itertools.count(1)
        self._step_ids = itertools.count(1)
        self._release_next: list[int] = []
        self._suspended: str | None = None  # why steps cannot run now (a backend service is down)
        self.backend_lost = threading.Event()  # a step failed because a backend service is unreachable
        self._session = 0  # bumped by suspend(): a step begun in an older session cannot flag the new one
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    # ---- submission (any thread) ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerationRequest, on_tokens: TokenCallback | None = None) -> Ticket:
        request.validate(self.spec)
        if request.stop and self.tokenizer is None:
            raise InvalidRequestError(
                "stop strings need the model's tokenizer.json to decode the output, and this model has none: "
                "send no stop strings (or serve a checkpoint with a tokenizer)"
            )
        if len(request.prompt_ids) > self.config.max_prefill_tokens:
            raise InvalidRequestError(
                f"prompt has {len(request.prompt_ids)} tokens; this server accepts at most "
                f"{self.config.max_prefill_tokens} (--max-prefill-tokens)"
            )
        blocks = -(-(len(request.prompt_ids) + request.max_new_tokens) // self.block_size)
        if blocks > self.kv_blocks:
            raise ResourceExhaustedError(
                f"prompt + max_new_tokens needs {blocks * self.block_size} KV tokens; the cache holds "
                f"{self.kv_blocks * self.block_size} in all"
            )
        ticket = Ticket(request, StopChecker(request, self.spec.eos_token_ids, self.tokenizer), 0, blocks, on_tokens)
        with self._cv:
            if self._stopping:
                raise ShuttingDownError("the server is shutting down")
            if self._suspended is not None:
                raise UnavailableError(f"{self._suspended}; retry shortly")
            if len(self._waiting) >= self.config.max_queue:
                raise ResourceExhaustedError(f"the request queue is full ({self.config.max_queue}); retry later")
            ticket.seq_id = next(self._seq_ids)
            self._waiting.append(ticket)
            metrics.WAITING.set(len(self._waiting))
            self._cv.notify_all()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        with self._cv:
            ticket.cancelled = True
            self._cv.notify_all()

    def stats(self) -> dict[str, int]:
        with self._cv:
            return {"waiting": len(self._waiting), "running": len(self._running), "free_blocks": self._free_blocks}

    def stop(self, drain_timeout: float = 0.0) -> None:
        """Stops admitting; lets running and queued requests finish for up to `drain_timeout`."""
        deadline = time.monotonic() + drain_timeout
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            while (self._waiting or self._running) and time.monotonic() < deadline:
                self._cv.wait(0.1)
        with self._cv:
            self._closed = True
            pending = list(self._waiting) + list(self._running)
            self._waiting.clear()
            self._running.clear()
            self._cv.notify_all()
        for t in pending:
            self._fail(t, ShuttingDownError("the server shut down before the request finished"))
        self._thread.join(timeout=10)

    # ---- the loop (scheduler thread) -------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while ((not self._waiting and not self._running) or self._suspended) and not self._closed:
                    self._cv.wait(0.5)
                if self._closed:
                    return
                self._drop_cancelled()
                new = self._admit()
            batch = new or list(self._running)
            if not batch:
                continue
            try:
                self._run_step(batch, prefill=bool(new))
            except Exception as exc:  # a bug must fail this step's requests, never stop the loop
                self.log.exception("scheduler_step_crashed")
                with self._cv:
                    for t in batch:
                        if t in self._running:
                            self._running.remove(t)
                        if not t.done.is_set():
                            self._finish(t, ServiceError(f"internal error in the scheduler: {exc}"), "failed")

    # ---- backend faults (the supervisor calls these) ---------------------------------------------
    def suspend(self, reason: str) -> int:
        """Stops running steps and ends every request with UNAVAILABLE: their KV lived in a service
        that restarted (or is about to be reset). Returns how many requests were ended."""
        with self._cv:
            self._suspended = reason
            self._session += 1
            ended = [*self._running, *self._waiting]
            self._running.clear()
            self._waiting.clear()
            for t in ended:
                if not t.done.is_set():
                    self._finish(t, UnavailableError(f"{reason}; the request was not completed, retry it"), "failed")
            metrics.WAITING.set(0)
            self._cv.notify_all()
        return len(ended)

    def resume(self, kv: KVCapacity) -> None:
        """After the backend was re-wired (a new session: every KV block is free again)."""
        with self._cv:
            self.kv_blocks, self.block_size = kv.blocks, kv.block_size
            self._free_blocks = kv.blocks
            self._release_next = []
            self._suspended = None
            self.backend_lost.clear()
            metrics.KV_USAGE.set(0.0)
            self._cv.notify_all()

    def _drop_cancelled(self) -> None:
        for t in [t for t in self._waiting if t.cancelled]:
            self._waiting.remove(t)
            self._finish(t, None, "cancelled")
        for t in [t for t in self._running if t.cancelled]:
            self._running.remove(t)
            self._finish(t, None, "cancelled")

    def _admit(self) -> list[Ticket]:
        new: list[Ticket] = []
        budget = self.config.max_prefill_tokens
        while self._waiting and len(self._running) + len(new) < self.config.max_batch_size:
            t = self._waiting[0]
            if t.blocks > self._free_blocks:
                break  # first come, first served: wait for KV to free up
            self._waiting.popleft()
            self._free_blocks -= t.blocks
            t.admitted = time.monotonic()
            metrics.QUEUE_TIME.observe(t.admitted - t.arrival)
            if self.planner is not None:
                self._apply_policy(self.planner.observe_request(len(t.request.prompt_ids), t.request.max_new_tokens))
            metrics.PROMPT_TOKENS.inc(len(t.request.prompt_ids))
            new.append(t)
            budget -= len(t.request.prompt_ids)
            if budget <= 0:
                break
        metrics.WAITING.set(len(self._waiting))
        metrics.KV_USAGE.set(1 - self._free_blocks / self.kv_blocks)
        self._running.extend(new)
        metrics.RUNNING.set(len(self._running))
        return new

    def _plan(self, tickets: list[Ticket], prefill: bool) -> StepPlan:
        works = []
        for t in tickets:
            if prefill:
                works.append(SequenceWork(t.seq_id, list(t.request.prompt_ids), 0, t.request.sampling))
            else:
                start = len(t.request.prompt_ids) + len(t.output) - 1
                works.append(SequenceWork(t.seq_id, [t.output[-1]], start))
        mbs: list[list[SequenceWork]] = []
        if prefill:  # pack prompts into micro-batches of at most max_prefill_tokens tokens
            tokens = 0
            for w in works:
                if not mbs or tokens + len(w.token_ids) > self.config.max_prefill_tokens:
                    mbs.append([])
                    tokens = 0
                mbs[-1].append(w)
                tokens += len(w.token_ids)
        else:  # balanced by context length: micro-batches of equal attention work, no padding
            size = self.config.micro_batch_size or len(works)
            contexts = [w.start + 1 for w in works]
            mbs = [[works[i] for i in group] for group in balance(contexts, -(-len(works) // size))]
        release, self._release_next = self._release_next, []
        kind = StepKind.PREFILL if prefill else StepKind.DECODE
        return StepPlan(next(self._step_ids), mbs, kind, release, self.placement)

    def _run_step(self, tickets: list[Ticket], prefill: bool) -> None:
        session = self._session
        plan = self._plan(tickets, prefill)
        kind = "prefill" if prefill else "decode"
        t0 = time.perf_counter()
        try:
            out = self.backend.step(plan)
        except Exception as exc:
            self.log.warning("step_failed", kind=kind, error=str(exc), code=status_for(exc).name)
            if status_for(exc) == grpc.StatusCode.UNAVAILABLE and session == self._session:
                self.backend_lost.set()  # the supervisor re-wires the stack and resumes
            with self._cv:
                for t in tickets:
                    if t.done.is_set():  # already ended (cancelled, or by a suspend meanwhile)
                        continue
                    if t in self._running:
                        self._running.remove(t)
                    self._finish(t, exc, "failed")
            return
        wall = time.perf_counter() - t0
        metrics.observe_step(kind, len(tickets), wall, out.timings.stages())
        if self.planner is not None and not prefill:
            try:  # the planner is advice: its failure must not cost the requests their tokens
                mu = max(len(mb) for mb in plan.micro_batches)
                policy = self.planner.observe_step(len(tickets), mu, out.timings.stages())
                with self._cv:
                    self._apply_policy(policy)
            except Exception:
                self.log.exception("planner_failed")
        self._apply(tickets, out)

    def _apply_policy(self, policy: Policy | None) -> None:
        """Takes a (re-)planned batch and micro-batch size; the running batch shrinks by attrition."""
        if policy is None:
            return
        if self.planner is not None and self.planner.fixed_batch is None:
            self.config.max_batch_size = policy.batch
        if self.planner is not None and self.planner.fixed_micro_batch is None:
            self.config.micro_batch_size = policy.micro_batch
        # attention placement never changes: its KV lives there
        self.placement = Placement(self.placement.attention, policy.experts)

    def _apply(self, tickets: list[Ticket], out: StepOutput) -> None:
        by_seq = dict(zip(out.seq_ids, out.token_ids, strict=True))
        now = time.monotonic()
        with self._cv:
            for t in tickets:
                if t.seq_id not in by_seq or t not in self._running:
                    continue
                token = by_seq[t.seq_id]
                t.output.append(token)
                if t.seq_id in out.logprobs:
                    t.logprobs.append(out.logprobs[t.seq_id])
                if not t.first_token:
                    t.first_token = now
                    metrics.TTFT.observe(now - t.arrival)
                metrics.GENERATION_TOKENS.inc()
                if t.on_tokens is not None:
                    lp = out.logprobs.get(t.seq_id)
                    t.on_tokens([token], [] if lp is None else [lp])
                reason = t.checker.check(t.output)
                if reason is not None:
                    self._running.remove(t)
                    self._finish(t, None, reason)

    def _finish(self, t: Ticket, error: BaseException | None, reason: str) -> None:
        """Called with the lock held: returns the request's KV and wakes its waiter."""
        t.finished = time.monotonic()
        if t.admitted:
            self._free_blocks += t.blocks
            self._release_next.append(t.seq_id)
        metrics.RUNNING.set(len(self._running))
        metrics.KV_USAGE.set(1 - self._free_blocks / self.kv_blocks)
        if error is not None:
            self._fail(t, error)
            return
        if reason == "cancelled":
            self._fail(t, ServiceError("the request was cancelled", grpc.StatusCode.CANCELLED))
            return
        t.result = GenerationResult(
            t.output, t.checker.final_text(t.output), reason, len(t.request.prompt_ids), t.logprobs[: len(t.output)]
        )
        metrics.REQUESTS.labels(reason).inc()
        metrics.E2E.observe(t.finished - t.arrival)
        if len(t.output) > 1:
            metrics.TPOT.observe((t.finished - t.first_token) / (len(t.output) - 1))
        self.log.info(
            "request_finished",
            request_id=t.request.request_id,
            finish_reason=reason,
            prompt_tokens=len(t.request.prompt_ids),
            completion_tokens=len(t.output),
            queue_s=round(t.admitted - t.arrival, 4),
            ttft_s=round(t.first_token - t.arrival, 4),
            e2e_s=round(t.finished - t.arrival, 4),
        )
        t.done.set()
        self._cv.notify_all()

    def _fail(self, t: Ticket, error: BaseException) -> None:
        t.error = error
        if not t.finished:
            t.finished = time.monotonic()
        metrics.REQUESTS.labels(status_for(error).name.lower()).inc()
        t.done.set()


class StreamSink:
    """Collects a ticket's tokens (and their log-probabilities) for a streaming waiter."""

    def __init__(self) -> None:
        self.queue: queue.Queue[tuple[list[int], list[TokenLogprobs]]] = queue.Queue()

    def __call__(self, tokens: list[int], logprobs: list[TokenLogprobs]) -> None:
        self.queue.put((tokens, logprobs))
