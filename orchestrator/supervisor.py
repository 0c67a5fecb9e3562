"""Watches the backend services and brings the stack back after one of them dies.

gpu_expert or cpu_attention down (a failed step says so at once; the health watch notices between
steps): the orchestrator goes NOT_SERVING, every request in flight ends with UNAVAILABLE (its KV
cache or sampler state died with the process), new requests are refused with UNAVAILABLE, and once
the services answer again (the launcher restarts them) the backend is re-wired, which starts a new
session on both, and the orchestrator is SERVING again. The weight store down: NOT_SERVING too,
but the workers keep their mapped weights, so requests in flight finish; SERVING again when it is
back (it adopts the arena the workers still map).

A health check that times out once (a worker busy in a long step, a GIL-bound moment) is not a death:
a worker counts as down after `misses` checks in a row fail, or at once when a step could not reach it
(issue 14: one missed 1 s check used to end every request in flight). The scheduler's loop thread
gone (it should never be, see Scheduler._turn) makes the orchestrator NOT_SERVING for good.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog
from prometheus_client import Counter

from orchestrator.backend import Backend, Capacity, KVCapacity
from orchestrator.scheduler import Scheduler

RECOVERIES = Counter("moe_lightning_backend_recoveries_total", "Times the backend was re-wired after a fault")
WORKERS = ("gpu_expert", "cpu_attention")
LOST_TICK = 0.05  # seconds between looks at the scheduler's backend_lost flag
HEALTH_MISSES = 3  # failed checks in a row before a worker counts as down (with interval 0.5 s: ~1.5-4.5 s)


class BackendSupervisor:
    def __init__(
        self,
        backend: Backend,
        scheduler: Scheduler,
        set_serving: Callable[[bool], None],
        capacity_of: Callable[[Capacity], KVCapacity],
        interval: float = 0.5,
        reconnect_timeout: float = 600.0,
        misses: int = HEALTH_MISSES,
    ) -> None:
        """`capacity_of`: the KV cache the scheduler admits against, from a new Capacity (the
        placement chosen at start decides which cache that is)."""
        self.backend = backend
        self.scheduler = scheduler
        self.set_serving = set_serving
        self.capacity_of = capacity_of
        self.interval = interval
        self.reconnect_timeout = reconnect_timeout
        self.misses = misses
        self._missed: dict[str, int] = {}  # per service: health checks failed in a row
        self.log = structlog.get_logger()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="backend-supervisor", daemon=True)

    @property
    def stopping(self) -> bool:  # for wait_serving's stop check
        return self._stop.is_set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        degraded = False
        dead = False
        tick = min(LOST_TICK, self.interval)
        next_check = 0.0
        while not self._stop.wait(tick):
            # a step that could not reach a worker is acted on within a tick; the health checks run
            # every interval (stop() must not wait out an interval either: the drain waits on it)
            lost = self.scheduler.backend_lost.is_set()
            if not lost and time.monotonic() < next_check:
                continue
            next_check = time.monotonic() + self.interval
            if not self.scheduler.alive:
                if not dead:  # nothing can run requests here: probes must send traffic elsewhere
                    self.log.error("scheduler_dead")
                    self.set_serving(False)
                    dead = True
                continue
            down = [] if lost else self._down()
            if lost or any(s in down for s in WORKERS):
                self._recover(f"backend service down: {', '.join(down) or 'a step could not reach it'}")
                self._missed.clear()
                degraded = False
            elif down:  # only the weight store: the workers run on their mapped weights
                if not degraded:
                    self.log.warning("backend_degraded", down=down)
                    self.set_serving(False)
                    degraded = True
            elif degraded:
                self.log.info("backend_restored")
                self.set_serving(True)
                degraded = False

    def _down(self) -> list[str]:
        """The services whose last `misses` health checks all failed."""
        failing = set(self.backend.unhealthy())
        for name in failing:
            self._missed[name] = self._missed.get(name, 0) + 1
        for name in list(self._missed):
            if name not in failing:
                del self._missed[name]
        return [name for name, n in self._missed.items() if n >= self.misses]

    def _recover(self, reason: str) -> None:
        t0 = time.monotonic()
        self.set_serving(False)
        ended = self.scheduler.suspend(reason)
        self.log.warning("backend_lost", reason=reason, requests_ended=ended)
        while not self._stop.is_set():
            try:
                capacity = self.backend.connect(timeout=self.reconnect_timeout, stop=self)
                break
            except Exception as exc:  # still restarting: keep trying until stopped
                self.log.info("backend_reconnect_retry", error=str(exc))
                self._stop.wait(1.0)
        else:
            return
        self.scheduler.resume(self.capacity_of(capacity))
        RECOVERIES.inc()
        self.set_serving(True)
        self.log.info("backend_recovered", seconds=round(time.monotonic() - t0, 2))
