"""The scheduler loop: one thread that asks the batcher for a step, runs it on the backend, and
hands each request's tokens to its waiter (unary, stream or batch) as soon as the step returns.

The batching decisions live in `batcher.py`; this module owns what is not pure: the thread and its
lock, the backend call, suspending and resuming around backend faults, the planner's feedback,
metrics and logs.
"""

from __future__ import annotations

import threading
import time

import grpc
import structlog

from moe_lightning.hrm.costmodel import Policy
from moe_lightning.hrm.prefill_budget import prefill_budget
from moe_lightning.output_text import OutputText
from moe_lightning.placement import Placement
from moe_lightning.request import GenerationRequest, GenerationResult
from moe_lightning.service.errors import ServiceError, ShuttingDownError, UnavailableError, status_for
from moe_lightning.service.runtime import MAX_MESSAGE_BYTES
from moe_lightning.spec import ModelSpec
from moe_lightning.step_protocol import StepKind
from moe_lightning.tokenizer import TextTokenizer
from moe_lightning.validation import RequestLimits, check_kv
from orchestrator import metrics
from orchestrator.backend import Backend, KVCapacity
from orchestrator.batcher import FINISH_CANCELLED, Batcher, NewToken, ScheduledStep, SchedulerConfig, Sequence
from orchestrator.grammars import Grammars
from orchestrator.planner import Planner
from orchestrator.step_faults import output_error, sampling_faults, step_error
from orchestrator.ticket import Ticket, TokenCallback

__all__ = ["Scheduler", "SchedulerConfig"]


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
        self.grammars = Grammars(spec, tokenizer)
        self.config = config
        self.planner = planner
        self.batcher = Batcher(kv, config, placement)  # guarded by _cv, like everything below
        metrics.publish_config(self.config)
        self.log = structlog.get_logger()
        self._tickets: dict[int, Ticket] = {}  # seq id -> its waiter, until it finished
        self._cv = threading.Condition()
        self._stopping = False
        self._closed = False
        self._suspended: str | None = None  # why steps cannot run now (a backend service is down)
        self.backend_lost = threading.Event()  # a step failed because a backend service is unreachable
        self._session = 0  # bumped by suspend(): a step begun in an older session cannot flag the new one
        self._dead: str | None = None  # why the loop thread ended on its own (then alive is False)
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    @property
    def kv_blocks(self) -> int:
        return self.batcher.kv.blocks

    @property
    def block_size(self) -> int:
        return self.batcher.kv.block_size

    def limits(self) -> RequestLimits:
        """What a request must fit now (the KV cache may differ after the backend was re-wired)."""
        return RequestLimits.of(
            self.spec,
            has_tokenizer=self.tokenizer is not None,
            max_prompt_tokens=self.config.max_prefill_tokens,
            kv_blocks=self.kv_blocks,
            kv_layout=self.batcher.kv.layout,
            max_response_bytes=MAX_MESSAGE_BYTES,  # the API's send limit: refuse what could not be returned
        )

    # ---- submission (any thread) ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerationRequest, on_tokens: TokenCallback | None = None) -> Ticket:
        """Queues a request the API validated (moe_lightning/validation.py)."""
        text = OutputText(request, self.spec.eos_token_ids, self.tokenizer, stream=on_tokens is not None)
        grammar = self.grammars.start(request)  # (compiled when the API checked it: cached)
        with self._cv:
            # again under the lock: the cache may have shrunk since the API looked (a resume), and a
            # request that can never fit would block the head of the queue for good
            check_kv(request, self.kv_blocks, self.batcher.kv.layout)
            if self._stopping:
                raise ShuttingDownError("the server is shutting down")
            if self._dead is not None:
                raise UnavailableError(f"{self._dead}; this server cannot run requests, use another")
            if self._suspended is not None:
                raise UnavailableError(f"{self._suspended}; retry shortly")
            if self.backend_lost.is_set():
                raise UnavailableError("a backend service could not be reached, the stack is recovering; retry shortly")
            seq = self.batcher.add(request, text)
            seq.grammar = grammar
            ticket = Ticket(seq, on_tokens)
            self._tickets[seq.seq_id] = ticket
            metrics.WAITING.set(len(self.batcher.waiting) + len(self.batcher.preempted))
            self._cv.notify_all()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        with self._cv:
            ticket.seq.cancelled = True
            self._cv.notify_all()

    def stats(self) -> dict[str, int]:
        with self._cv:
            b = self.batcher
            return {
                "waiting": len(b.waiting) + len(b.preempted),
                "running": len(b.running),
                "free_blocks": b.free_blocks,
                "preemptions": b.counters.preemptions,
            }

    @property
    def stopping(self) -> bool:
        """stop() was called: no new request is admitted."""
        return self._stopping

    def stop(self, drain_timeout: float = 0.0) -> None:
        """Stops admitting; lets running and queued requests finish for up to `drain_timeout`."""
        deadline = time.monotonic() + drain_timeout
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            while (self.batcher.queued or self.batcher.running) and time.monotonic() < deadline:
                self._cv.wait(0.1)
        with self._cv:
            self._closed = True
            pending = [*self.batcher.queued, *self.batcher.running.values()]
            self.batcher.remove(pending)
            self._cv.notify_all()
            for seq in pending:
                self._fail(seq, ShuttingDownError("the server shut down before the request finished"))
        self._thread.join(timeout=10)

    # ---- backend faults (the supervisor calls these) ---------------------------------------------
    def suspend(self, reason: str) -> int:
        """Stops running steps and ends every request with UNAVAILABLE: their KV lived in a service
        that restarted (or is about to be reset). Returns how many requests were ended."""
        with self._cv:
            self._suspended = reason
            self._session += 1
            ended = self.batcher.reset(self.batcher.kv)
            for seq in ended:
                self._fail(seq, UnavailableError(f"{reason}; the request was not completed, retry it"))
            self._publish_gauges()
            self._cv.notify_all()
        return len(ended)

    def resume(self, kv: KVCapacity) -> None:
        """After the backend was re-wired (a new session: every KV block is free again)."""
        with self._cv:
            self.batcher.reset(kv)
            self._suspended = None
            self.backend_lost.clear()
            self._publish_gauges()
            self._cv.notify_all()

    # ---- the loop (scheduler thread) -------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """False once the loop thread ended without stop(): nothing runs requests, health must say so."""
        return self._dead is None

    def _loop(self) -> None:
        try:
            while self._turn():
                pass
        except BaseException as exc:  # the guards in _turn failed themselves
            self._dead = f"the scheduler stopped after an internal error ({exc!r})"
            self.log.exception("scheduler_loop_died")
        finally:
            if not self._closed:  # no waiter may hang on a loop that is gone, nor a caller queue behind it
                self._dead = self._dead or "the scheduler stopped"
                with self._cv:
                    self._fail_all(UnavailableError(f"{self._dead}; the request was not completed"))

    def _turn(self) -> bool:
        """One step of the loop: False once stop() closed it. Any exception ends the requests it
        concerns and the loop goes on (issue 14, item 8: it used to kill the thread silently)."""
        with self._cv:
            b = self.batcher
            # a lost backend fails every step at once: stepping on would spin (a failed step's releases
            # go with the next plan) until the supervisor suspends, starving the restart of the CPU
            while (b.idle or self._suspended or self.backend_lost.is_set()) and not self._closed:
                self._cv.wait(0.5)
            if self._closed:
                return False
            try:
                for seq in b.drop_cancelled():
                    self._finish(seq)
                before = (b.counters.preemptions, b.counters.recomputed_tokens)
                step = b.schedule(self._admitted)
                self._publish_gauges()
                self._count_preemptions(*before)
            except Exception as exc:  # which requests the fault left half-moved is unknown: end them all
                self.log.exception("scheduler_schedule_crashed")
                self._fail_all(ServiceError(f"internal error in the scheduler: {exc}; the request was not completed"))
                self._cv.wait(0.1)  # a fault that repeats must not spin the loop
                return True
        if step is None:
            return True
        try:
            self._run(step)
        except Exception as exc:  # a bug must fail this step's requests, never stop the loop
            self.log.exception("scheduler_step_crashed")
            with self._cv:
                self.batcher.step_failed(step)
                self._end([(s, ServiceError(f"internal error in the scheduler: {exc}")) for s in step.sequences])
        return True

    def _fail_all(self, error: BaseException) -> None:
        """Ends every request not finished yet (lock held); their KV blocks come back and are released."""
        try:
            self.batcher.remove([*self.batcher.queued, *self.batcher.running.values()])
        except Exception:  # even so, every waiter below is told
            self.log.exception("scheduler_remove_failed")
        for ticket in list(self._tickets.values()):
            self._fail(ticket.seq, error)

    def _count_preemptions(self, preemptions: int, recomputed: int) -> None:
        """The schedule() just made preempted sequences: counted, and logged (lock held)."""
        c = self.batcher.counters
        if c.preemptions > preemptions:
            metrics.PREEMPTIONS.inc(c.preemptions - preemptions)
            self.log.info("preempted", sequences=c.preemptions - preemptions, free_blocks=self.batcher.free_blocks)
        if c.recomputed_tokens > recomputed:
            metrics.RECOMPUTED_TOKENS.inc(c.recomputed_tokens - recomputed)

    def _admitted(self, seq: Sequence) -> None:
        """Called by the batcher, with the lock held, as it admits each sequence."""
        ticket = self._tickets[seq.seq_id]
        ticket.admitted = time.monotonic()
        metrics.QUEUE_TIME.observe(ticket.admitted - ticket.arrival)
        metrics.PROMPT_TOKENS.inc(seq.prompt_len)
        if self.planner is not None:
            try:  # advice, as in _run: a planner fault must not cost the request its admission
                self._apply_policy(self.planner.observe_request(seq.prompt_len, seq.request.max_new_tokens))
            except Exception:
                self.log.exception("planner_failed")

    def _run(self, step: ScheduledStep) -> None:
        session, plan = self._session, step.plan
        t0 = time.perf_counter()
        try:
            # the scheduler's thread alone moves grammar states (in update, below): no lock needed here
            out = self.grammars.run_step(step, self.backend, self.config.mask_overlap, self._end_alone)
        except Exception as exc:
            self.log.warning("step_failed", kind=plan.kind, error=str(exc), code=status_for(exc).name)
            if (lost := status_for(exc) == grpc.StatusCode.UNAVAILABLE) and session == self._session:
                self.backend_lost.set()  # the supervisor re-wires the stack and resumes
            with self._cv:
                if session == self._session:  # (a new session's workers hold nothing of the old one's)
                    self.batcher.step_failed(step)
                error = step_error(plan, exc, lost)
                self._end([(s, error) for s in step.sequences])
            return
        wall = time.perf_counter() - t0
        if not plan.micro_batches:
            return  # it only released finished sequences
        metrics.observe_step(step.decodes, wall, out.timings)
        if self.planner is not None and plan.kind is StepKind.DECODE:
            try:  # the planner is advice: its failure must not cost the requests their tokens
                mu = max(len(mb) for mb in plan.micro_batches)
                policy = self.planner.observe_step(plan.num_sequences, mu, out.timings)
                with self._cv:
                    self._apply_policy(policy)
            except Exception:
                self.log.exception("planner_failed")
        now = time.monotonic()
        with self._cv:
            self._end(sampling_faults(step.sequences, out), alone=True)  # before update: these take no token
            faults: list[tuple[Sequence, BaseException]] = []
            tokens = self.batcher.update(step, out, lambda seq, exc: faults.append((seq, output_error(exc))))
            faults += self.grammars.advance(tokens)
            self._end(faults, alone=True)
            for new in [t for t in tokens if t.seq.seq_id in self._tickets]:  # (not those just ended)
                self._deliver(new, now)
            self._publish_gauges()

    def _apply_policy(self, policy: Policy | None) -> None:
        """Takes a (re-)planned batch and micro-batch size; the running batch shrinks by attrition."""
        if policy is None or self.planner is None:
            return
        if self.planner.fixed_batch is None:
            self.config.max_batch_size = policy.batch
        if self.planner.fixed_micro_batch is None:
            self.config.micro_batch_size = policy.micro_batch_size
        if self.planner.fixed_prefill_budget is None:
            self.config.prefill_budget = prefill_budget(self.planner.estimate, self.config.max_prefill_tokens)
        if self.planner.fixed_expert_groups is None:
            self.config.expert_groups = policy.expert_groups
        metrics.publish_config(self.config)
        c = self.config
        self.planner.publish_in_force(c.max_batch_size, c.micro_batch_size, c.expert_groups)
        # attention placement never changes: its KV lives there
        self.batcher.placement = Placement(self.batcher.placement.attention, policy.experts)

    def _end(self, ended: list[tuple[Sequence, BaseException]], alone: bool = False) -> None:
        """Sequences end with their errors (lock held); `alone`: their own part of a step raised (issue 54)."""
        live = [(seq, error) for seq, error in ended if seq.seq_id in self._tickets]
        self.batcher.remove([seq for seq, _ in live])
        for seq, error in live:
            if alone:
                self.log.info("sequence_failed", request_id=seq.request.request_id, error=str(error))
            self._fail(seq, error)
        self._publish_gauges()

    def _end_alone(self, ended: list[tuple[Sequence, BaseException]]) -> None:  # (lock not held)
        with self._cv:
            self._end(ended, alone=True)

    def _deliver(self, new: NewToken, now: float) -> None:
        ticket = self._tickets[new.seq.seq_id]
        if not ticket.first_token:
            ticket.first_token = now
            metrics.TTFT.observe(now - ticket.arrival)
        metrics.GENERATION_TOKENS.inc()
        if ticket.on_tokens is not None:  # before _finish sets done: the API reads "done, queue empty" as the end
            ticket.on_tokens([new.token_id], [] if new.logprobs is None else [new.logprobs], new.text)
        if new.finish_reason is not None:
            self._finish(new.seq)

    # ---- outcomes (lock held) --------------------------------------------------------------------
    def _publish_gauges(self) -> None:
        metrics.WAITING.set(len(self.batcher.waiting) + len(self.batcher.preempted))
        metrics.RUNNING.set(len(self.batcher.running))
        metrics.KV_USAGE.set(self.batcher.kv_usage)

    def _finish(self, seq: Sequence) -> None:
        """A sequence the batcher finished (a stop, its length, EOS) or dropped as cancelled."""
        ticket = self._tickets[seq.seq_id]  # popped once resolved: should this raise, _fail_all still finds it
        ticket.finished = time.monotonic()
        reason = seq.finish_reason
        assert reason is not None
        if reason == FINISH_CANCELLED:
            self._fail(seq, ServiceError("the request was cancelled", grpc.StatusCode.CANCELLED))
            return
        ticket.result = GenerationResult(
            seq.output,
            seq.text.final_text,
            reason,
            seq.prompt_len,
            seq.logprobs[: len(seq.output)],
            seq.preemptions,
            seq.prompt_logprobs,
        )
        self._tickets.pop(seq.seq_id)
        try:
            metrics.REQUESTS.labels(reason).inc()
            metrics.E2E.observe(ticket.finished - ticket.arrival)
            if len(seq.output) > 1:
                metrics.TPOT.observe((ticket.finished - ticket.first_token) / (len(seq.output) - 1))
            self.log.info(
                "request_finished",
                request_id=seq.request.request_id,
                finish_reason=reason,
                prompt_tokens=seq.prompt_len,
                completion_tokens=len(seq.output),
                preemptions=seq.preemptions,
                queue_s=round(ticket.admitted - ticket.arrival, 4),
                ttft_s=round(ticket.first_token - ticket.arrival, 4),
                e2e_s=round(ticket.finished - ticket.arrival, 4),
            )
        finally:  # the result is complete: the waiter gets it whatever the metrics do
            ticket.complete()
            self._cv.notify_all()

    def _fail(self, seq: Sequence, error: BaseException) -> None:
        ticket = self._tickets.pop(seq.seq_id, None)
        if ticket is None:
            return  # already ended
        self._resolve(ticket, error)

    def _resolve(self, ticket: Ticket, error: BaseException) -> None:
        ticket.error = error
        if not ticket.finished:
            ticket.finished = time.monotonic()
        try:
            metrics.REQUESTS.labels(status_for(error).name.lower()).inc()
        finally:  # the waiter is told whatever the metrics do
            ticket.complete()
            self._cv.notify_all()
