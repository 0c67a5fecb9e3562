"""The mailbox of the token masks that come apart from their step (issue 54): the orchestrator sends a
step whose structured-output rows have `mask_follows` at once and fills their masks while its layers run
(vLLM's overlap); they arrive in a SetStepMasks call, on a gRPC thread, while the step holds the step
lock. The head waits here only when it samples, and no longer than `timeout`.

At most one step runs at a time, so the box holds the running step's delivery and at most one that came
early (the SetStepMasks call can overtake its Step call on the way in): nothing piles up. A step that
ended, sampled or failed, takes its entry with it; a delivery for it that comes late is dropped (step
ids grow within a session)."""

from __future__ import annotations

import threading
import time

from prometheus_client import Counter, Histogram

Masks = dict[int, bytes]  # seq id -> its token mask (a row left out goes without)

WAITED = Histogram(
    "moe_lightning_grammar_mask_wait_seconds",
    "How long the head waited for a step's grammar masks after its layers ran (0: they were there)",
    buckets=(0.0, 0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0),
)
DELIVERIES = Counter(
    "moe_lightning_grammar_mask_deliveries_total",
    "SetStepMasks calls, by when they came: while their step ran, before it began, or after it ended (dropped)",
    ["arrival"],
)
TIMEOUTS = Counter("moe_lightning_grammar_mask_timeouts_total", "Steps whose grammar masks did not come in time")


class StepMasks:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._cv = threading.Condition()
        self._running: int | None = None  # the step between begin() and end()
        self._ended: int | None = None  # the last step that ended: a late delivery (of it or before) is dropped
        self._boxes: dict[int, Masks] = {}  # step id -> its delivery (the running step's, or one early)

    def begin(self, step_id: int) -> None:
        """A step starts: an early delivery of another step is stale (its step never came) and goes."""
        with self._cv:
            self._running = step_id
            self._boxes = {k: v for k, v in self._boxes.items() if k == step_id}

    def end(self, step_id: int) -> None:
        """The step ended (sampled, or failed anywhere): its entry goes with it."""
        with self._cv:
            self._boxes.pop(step_id, None)
            self._running, self._ended = None, step_id

    def deliver(self, step_id: int, masks: Masks) -> None:
        with self._cv:
            # step ids grow within a session (Connect resets the box): one not above the last ended is late
            if self._ended is not None and step_id <= self._ended and step_id != self._running:
                DELIVERIES.labels("late").inc()
                return
            DELIVERIES.labels("during" if step_id == self._running else "early").inc()
            if step_id != self._running:  # an early one replaces any other early one: one at most
                self._boxes = {k: v for k, v in self._boxes.items() if k == self._running}
            self._boxes[step_id] = masks
            self._cv.notify_all()

    def wait(self, step_id: int) -> Masks | None:
        """The running step's masks; None when they did not come within the timeout."""
        t0 = time.perf_counter()
        with self._cv:
            came = self._cv.wait_for(lambda: step_id in self._boxes, self.timeout)
            WAITED.observe(time.perf_counter() - t0)
            if not came:
                TIMEOUTS.inc()
                return None
            return self._boxes[step_id]

    def reset(self) -> None:
        """A new session (Connect): nothing of the old one's steps is kept."""
        with self._cv:
            self._boxes.clear()
            self._running = self._ended = None

    @property
    def running(self) -> int | None:
        """The step between begin() and end(), if any."""
        with self._cv:
            return self._running

    def __len__(self) -> int:
        with self._cv:
            return len(self._boxes)
