"""The metrics port's own pages (moe_lightning/service/metrics_http.py, orchestrator/debug.py) without a
stack: who may read them, what they answer without matplotlib or before a step, and the spans the
workers keep for them (TimelineRecorder.recent). tests/test_monitoring.py reads them from a real stack."""

from __future__ import annotations

import io
import json
import urllib.request
from collections.abc import Mapping
from typing import Any

import pytest

from moe_lightning.service.convert import timeline_from_pb, timeline_to_pb
from moe_lightning.service.metrics_http import Page, make_app, start_metrics_server
from moe_lightning.timeline import TimelineRecorder
from orchestrator import debug
from orchestrator.debug import DebugPages


def _hello(query: Mapping[str, list[str]]) -> Page:
    return Page(200, "text/plain", f"hello {query.get('who', ['?'])[0]}".encode())


def _call(app: Any, path: str, auth: str | None = None, query: str = "") -> tuple[str, dict[str, str], bytes]:
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        seen["status"], seen["headers"] = status, dict(headers)

    environ = {"PATH_INFO": path, "QUERY_STRING": query, "REQUEST_METHOD": "GET", "wsgi.input": io.BytesIO()}
    environ |= {"HTTP_AUTHORIZATION": auth} if auth is not None else {}
    body = b"".join(app(environ, start_response))
    return seen["status"], seen["headers"], body


def test_on_loopback_the_pages_are_open_like_metrics() -> None:
    app = make_app({"/debug/hello": _hello}, token=None, exposed=False)
    assert _call(app, "/debug/hello", query="who=ops")[::2] == ("200 OK", b"hello ops")
    status, _, body = _call(app, "/debug/nope")
    assert status == "404 Not Found" and b"/debug/hello" in body
    status, _, body = _call(app, "/metrics")
    assert status.startswith("200") and b"# HELP" in body


def test_beyond_loopback_the_pages_need_the_token_and_metrics_do_not() -> None:
    app = make_app({"/debug/hello": _hello}, token="s3cret", exposed=True)
    status, headers, _ = _call(app, "/debug/hello")
    assert status == "401 Unauthorized" and headers["WWW-Authenticate"] == "Bearer"
    assert _call(app, "/debug/hello", auth="Bearer wrong")[0] == "401 Unauthorized"
    assert _call(app, "/debug/hello", auth="Bearer s3cret")[0] == "200 OK"
    assert _call(app, "/metrics")[0].startswith("200")  # what Prometheus scrapes stays open


def test_beyond_loopback_without_a_token_the_pages_are_off() -> None:
    app = make_app({"/debug/hello": _hello}, token=None, exposed=True)
    status, _, body = _call(app, "/debug/hello", auth="Bearer anything")
    assert status == "403 Forbidden" and b"--auth-token" in body


def test_a_failing_page_answers_500_and_the_port_stays_up() -> None:
    def broken(query: Mapping[str, list[str]]) -> Page:
        raise RuntimeError("boom")

    app = make_app({"/debug/broken": broken}, token=None, exposed=False)
    status, _, body = _call(app, "/debug/broken")
    assert status == "500 Internal Server Error" and b"boom" in body


def test_the_server_binds_loopback_and_serves_both() -> None:
    server, port = start_metrics_server("127.0.0.1", 0, {"/debug/hello": _hello}, None)
    try:
        assert server.server_address[0] == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/debug/hello?who=me", timeout=10) as r:
            assert r.read() == b"hello me"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert b"# HELP" in r.read()
    finally:
        server.shutdown()
        server.server_close()


class _Backend:
    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def timeline(self, steps: int) -> list[Any]:
        return self.events


def test_pictures_without_matplotlib_answer_501_and_the_trace_still_works(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = TimelineRecorder(None, "gpu_expert", keep=100)
    rec.record("device", "pre_attention", 0, 0, 0, 10, 20)
    pages = DebugPages(_Backend(rec.recent(steps=1)))  # type: ignore[arg-type]
    pages.planner = object()  # type: ignore[assignment]  # planned: the trace only needs the backend
    real = debug.importlib.util.find_spec
    monkeypatch.setattr(debug.importlib.util, "find_spec", lambda name: None if name == "matplotlib" else real(name))
    for page in (pages.timeline_png, pages.roofline_png):
        answer = page({})
        assert answer.status == 501 and b"pip install 'moe-lightning[plot]'" in answer.body
    trace = pages.trace_json({"steps": ["1"]})
    assert trace.status == 200 and json.loads(trace.body)["traceEvents"]


def test_pages_before_the_plan_and_before_any_step() -> None:
    pages = DebugPages(_Backend([]))  # type: ignore[arg-type]
    assert pages.trace_json({}).status == 503  # still starting
    pages.planner = object()  # type: ignore[assignment]
    answer = pages.trace_json({})
    assert answer.status == 404 and b"send a request" in answer.body
    assert pages.trace_json({"steps": ["x"]}).status == 400


def test_the_recorder_keeps_the_last_steps_and_the_copies_between_them() -> None:
    rec = TimelineRecorder(None, "gpu_expert", keep=6)
    for step in range(4):  # 2 spans per step: the oldest fall out of the 6 kept
        t = 100 * step
        rec.record("device", "pre_attention", step, 0, 0, t, t + 10)
        rec.record("device", "post_attention", step, 0, 0, t + 20, t + 30)
    rec.record("copy", "expert_copy", -1, 1, -1, 305, 315)  # a copy during step 3
    rec.record("copy", "expert_copy", -1, 1, -1, 500, 510)  # one after it: not part of the last steps
    assert [(e.step, e.start_ns) for e in rec.recent(steps=1)] == [(3, 300), (-1, 305), (3, 320)]
    assert {e.step for e in rec.recent(steps=2)} == {2, 3, -1}
    assert [e.start_ns for e in rec.recent(start_ns=310, end_ns=505)] == [305, 320, 500]
    assert TimelineRecorder(None, "x").recent(steps=3) == [] and not TimelineRecorder(None, "x").enabled


def test_the_recorder_counts_steps_as_recorded_not_by_number() -> None:
    """A restarted orchestrator numbers steps from 0 again: the newest are the last recorded."""
    rec = TimelineRecorder(None, "cpu_attention", keep=100)
    rec.record("cpu", "attention", 900, 0, 0, 1, 2)
    rec.record("cpu", "attention", 0, 0, 0, 3, 4)
    assert [e.step for e in rec.recent(steps=1)] == [0]


def test_spans_cross_the_rpc_unchanged() -> None:
    rec = TimelineRecorder(None, "gpu_expert", keep=10)
    rec.record("device", "head", 7, -1, -1, 5, 9)
    rec.record("copy", "expert_copy", -1, 3, -1, 6, 8)
    events = rec.recent(steps=1)
    assert timeline_from_pb(timeline_to_pb(events)) == events
