"""A request's life as its waiter sees it: the batcher's sequence, its times, and the outcome that
wakes every kind of waiter (unary, stream, batch)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from moe_lightning.request import GenerationRequest, GenerationResult
from moe_lightning.sampling import TokenLogprobs
from orchestrator.batcher import Sequence

# (new token ids, their log-probabilities when the request asked for them, else [], the text they
# complete for a stream: the request's OutputText delta, "" while text is held back)
TokenCallback = Callable[[list[int], list[TokenLogprobs], str], None]


@dataclass(slots=True)
class Ticket:
    """A request's life as its waiter sees it: the batcher's sequence, times, and the outcome."""

    seq: Sequence
    on_tokens: TokenCallback | None = None
    arrival: float = field(default_factory=time.monotonic)
    admitted: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    result: GenerationResult | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    _callbacks: list[Callable[[], None]] = field(default_factory=list)
    _callbacks_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def request(self) -> GenerationRequest:
        return self.seq.request

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Calls `fn` (from the scheduler's thread) once the ticket is done; at once if it is already."""
        with self._callbacks_lock:
            if not self.done.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def complete(self) -> None:
        """The outcome (result or error) is set: wakes every kind of waiter."""
        with self._callbacks_lock:
            self.done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def wait(self, timeout: float | None = None) -> GenerationResult:
        if not self.done.wait(timeout):
            raise TimeoutError("request did not finish in time")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result
