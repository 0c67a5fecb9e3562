"""The GPU check's optional phases, after the main comparison: each runs only when the deadline
leaves it the time it needs, and is recorded as skipped (with the reason) otherwise; one that fails
or raises is recorded and the next one still runs."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from bench.gpucheck import log

RESERVE = 10.0  # seconds kept at the end for the summary and the archive


@dataclass(frozen=True, slots=True)
class OptionalPhase:
    name: str
    needs: float  # seconds below which it is not started (what it takes on an H200, with a margin)
    cap: float  # its timeout when the deadline allows it
    run: Callable[[float], Any]  # given its timeout


def run_optional(check: Any, phases: Iterable[OptionalPhase], skip: Iterable[str] = ()) -> None:
    """Runs `phases` in order through `check` (a PhaseRunner: left(), record())."""
    skip = set(skip)
    for phase in phases:
        left = check.left() - RESERVE
        if phase.name in skip:
            reason = "--skip"
        elif left < phase.needs:
            reason = f"{max(0.0, left):.0f} s left before the deadline, it needs {phase.needs:.0f} s"
        else:
            reason = None
        if reason:
            check.record(phase.name, ok=None, skipped=reason)
            log(f"{phase.name}: skipped ({reason})")
            continue
        try:
            phase.run(min(phase.cap, left))
        except Exception as exc:  # a broken optional phase is a finding, never the end of the run
            check.record(phase.name, ok=False, error=f"{type(exc).__name__}: {exc}")
            log(f"{phase.name}: FAILED: {type(exc).__name__}: {exc}")
