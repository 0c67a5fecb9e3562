"""The pipeline picture, live, on the orchestrator's metrics port (moe_lightning/service/metrics_http.py):

* /debug/timeline.png: a few layers of a decode step among the last `steps` (default 3), one lane per
  resource, as `moe-lightning timeline --png` draws a recorded run;
* /debug/trace.json: those steps' spans as a Chrome trace (Perfetto opens it);
* /debug/roofline.png: the roofline of the plan in force, with the roofs as the planner now has them
  (corrected online when it re-planned).

The spans are the ones gpu_expert and cpu_attention keep in memory (--timeline-keep), fetched over
their GetTimeline RPC when a page is asked for; nothing is recorded here. The pictures need
matplotlib (the `plot` extra): without it they answer 501, the trace does not need it.
"""

from __future__ import annotations

import importlib.util
import io
import json
import threading
from collections.abc import Callable, Mapping
from typing import IO

from moe_lightning.service.metrics_http import Page, Route
from moe_lightning.timeline import Event, to_chrome_trace
from orchestrator.backend import Backend
from orchestrator.planner import Planner

DEFAULT_STEPS = 3
MAX_STEPS = 64  # bounds what one request makes the workers send and this process draw
NO_MATPLOTLIB = "this picture needs matplotlib, which is not installed: pip install 'moe-lightning[plot]'"


class DebugPages:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.planner: Planner | None = None  # set once the stack is planned
        self._draw = threading.Lock()  # pyplot keeps global state: one picture at a time

    def routes(self) -> dict[str, Route]:
        return {
            "/debug/timeline.png": self.timeline_png,
            "/debug/trace.json": self.trace_json,
            "/debug/roofline.png": self.roofline_png,
        }

    def _events(self, query: Mapping[str, list[str]]) -> list[Event] | Page:
        try:
            steps = int(query.get("steps", [str(DEFAULT_STEPS)])[0])
        except ValueError:
            return Page.text(400, "steps must be a whole number")
        if not 1 <= steps <= MAX_STEPS:
            return Page.text(400, f"steps must be 1 to {MAX_STEPS}")
        if self.planner is None:
            return Page.text(503, "the orchestrator is still starting: no step has run")
        try:
            events = self.backend.timeline(steps)
        except Exception as exc:  # a worker down or restarting: the page says so, the port stays up
            return Page.text(503, f"the workers did not answer: {exc}")
        if not events:
            return Page.text(404, "no step recorded yet: send a request (the workers keep none with --timeline-keep 0)")
        return events

    def trace_json(self, query: Mapping[str, list[str]]) -> Page:
        events = self._events(query)
        if isinstance(events, Page):
            return events
        return Page(200, "application/json", json.dumps(to_chrome_trace(events)).encode())

    def timeline_png(self, query: Mapping[str, list[str]]) -> Page:
        if importlib.util.find_spec("matplotlib") is None:
            return Page.text(501, NO_MATPLOTLIB)
        events = self._events(query)
        if isinstance(events, Page):
            return events
        from moe_lightning.timeline_plot import plot_timeline

        steps = sorted({e.step for e in events if e.step >= 0})
        title = f"live: the last {len(steps)} step(s), {steps[0]}-{steps[-1]}"
        return self._png(lambda out: plot_timeline(events, out, title))

    def roofline_png(self, query: Mapping[str, list[str]]) -> Page:
        if importlib.util.find_spec("matplotlib") is None:
            return Page.text(501, NO_MATPLOTLIB)
        planner = self.planner
        if planner is None:
            return Page.text(503, "the orchestrator is still starting: nothing is planned yet")
        from moe_lightning.hrm.plot import plot_roofline

        estimate, profile = planner.estimate, planner.profile
        title = f"{planner.spec.architecture} on {profile.name} ({profile.source}), the plan in force"
        return self._png(lambda out: plot_roofline(profile, estimate, title, out))

    def _png(self, draw: Callable[[IO[bytes]], object]) -> Page:
        out = io.BytesIO()
        with self._draw:
            draw(out)
        return Page(200, "image/png", out.getvalue())
