"""deploy/'s monitoring for real: Debian's Prometheus (installed here when it is missing and this user
may apt-get; else these tests skip and say why) scrapes a running stack, with the deploy config's jobs
and alert rules, during a short job; then every query of the Grafana dashboard returns data, every
alert's inputs exist and every rule evaluates, and promtool passes the config, the rules and the
rules' own unit tests. A renamed metric or label therefore fails here instead of blanking a panel or
silencing an alert. The orchestrator's /debug pages serve a real PNG and a trace that parses."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from bench.monitoring import dashboard, prometheus
from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.launcher import Stack
from moe_lightning.spec import ModelSpec

from reference import device_budget

ROOT = Path(__file__).resolve().parents[1]
PROM_DIR = ROOT / "deploy" / "prometheus"
JOB_NAMES = {"orchestrator", "weight_store", "gpu_expert", "cpu_attention", "gateway"}


@pytest.fixture(scope="session")
def prometheus_bins() -> tuple[str, str]:
    found = prometheus.binaries()
    if isinstance(found, str):
        pytest.skip(found)
    return found


def test_promtool_passes_the_config_the_rules_and_their_unit_tests(prometheus_bins: tuple[str, str]) -> None:
    promtool = prometheus_bins[1]
    for args in (
        ["check", "config", "prometheus.yml"],
        ["check", "rules", "alerts.yml"],
        ["test", "rules", "alerts_test.yml"],  # each alert fires on what it is for, not on a healthy stack
    ):
        out = subprocess.run([promtool, *args], cwd=PROM_DIR, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"promtool {' '.join(args)}:\n{out.stdout}\n{out.stderr}"


def test_every_metric_the_dashboard_and_the_alerts_name_is_exported_somewhere() -> None:
    """A cheap, static first line (the live test below is the real one): each name is defined in code."""
    code = "\n".join(
        p.read_text()
        for d in ("moe_lightning", "services", "orchestrator", "gateway")
        for p in (ROOT / d).rglob("*.py")
    )
    defined = set(re.findall(r'"(moe_lightning_\w+)"', code))
    exprs = [t["expr"] for p in dashboard.panels(dashboard.load()) for t in p["targets"]]
    exprs += [r["expr"] for r in dashboard.alert_rules()]
    for expr in exprs:
        for sel in dashboard.selectors(dashboard.fill_macros(expr)):
            name = re.sub(r"_(bucket|sum|count)$", "", sel.split("{")[0])
            assert name in defined or not name.startswith("moe_lightning_"), f"{name} (in {expr!r}) is exported nowhere"


# ---- a real stack, scraped --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(make_module_stack: Callable[..., Stack], tiny_model: Path) -> Stack:
    spec = ModelSpec.from_pretrained(tiny_model)
    return make_module_stack(
        model=tiny_model,
        http_port=0,
        max_batch_size=8,
        micro_batch_size=4,  # two micro-batches: the overlap the pipeline panels show
        experts_placement="gpu",
        device_memory=str(device_budget(tiny_model, ring=spec.num_experts + 1)),  # every expert streams
    )


@pytest.fixture(scope="module")
def prom(
    prometheus_bins: tuple[str, str], stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[prometheus.Prometheus]:
    targets = prometheus.targets_of(stack)
    assert set(targets) == JOB_NAMES  # the deploy config's jobs, all of them
    server = prometheus.Prometheus(prometheus_bins[0], tmp_path_factory.mktemp("prom"), prometheus.config_for(targets))
    server.start()
    try:
        server.wait_scraped(JOB_NAMES)  # a sample before the job: rate() needs two
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def job(stack: Stack, prom: prometheus.Prometheus) -> float:
    """A short job through both APIs (a batch, a stream, the gateway), with a client's mistakes on each;
    returns when Prometheus has scraped its end."""
    with GenerationClient(stack.api_address, timeout=60) as c:
        done = c.batch_generate([Prompt(token_ids=[1, 7 + i, 9], max_new_tokens=12, ignore_eos=True) for i in range(8)])
        assert all(len(d.token_ids) == 12 for d in done)
        assert list(c.stream(Prompt(text="Hello there", max_new_tokens=8)))
        with pytest.raises(grpc.RpcError) as bad:  # an error the errors panel must show
            c.generate(Prompt(token_ids=[1, 10**6], max_new_tokens=4))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    model = httpx.get(f"{stack.http_address}/v1/models").json()["data"][0]["id"]
    ok = httpx.post(f"{stack.http_address}/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 6})
    assert ok.status_code == 200, ok.text
    wrong = httpx.post(f"{stack.http_address}/v1/completions", json={"model": "nope", "prompt": "Hi", "max_tokens": 6})
    assert wrong.status_code == 404
    time.sleep(2.5)  # two scrapes after the job
    return time.time()


def test_every_dashboard_query_returns_data(prom: prometheus.Prometheus, job: float) -> None:
    empty = []
    for panel in dashboard.panels(dashboard.load()):
        for t in panel["targets"]:
            expr = dashboard.fill_macros(t["expr"])
            if not prom.query(expr, at=job):
                empty.append(f"{panel['title']} / {t['legendFormat']}: {expr}")
    assert not empty, "panels with no data:\n" + "\n".join(empty)


def test_every_alert_input_exists_and_every_rule_evaluates(prom: prometheus.Prometheus, job: float) -> None:
    rules = dashboard.alert_rules()
    for rule in rules:
        sels = dashboard.selectors(rule["expr"])
        assert sels, rule["alert"]
        for sel in sels:
            assert prom.query(sel, at=job), f"{rule['alert']}: nothing matches {sel}"
        prom.query(rule["expr"], at=job)  # evaluates (an error raises); empty: the alert does not fire
    # `up` is selected by job name: every job of the config is among them
    (down,) = [r for r in rules if r["alert"] == "MoeLightningServiceDown"]
    assert {s["metric"]["job"] for s in prom.query(down["expr"].split("==")[0], at=job)} == JOB_NAMES
    loaded = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
    assert {r["name"] for r in loaded} == {r["alert"] for r in rules}
    assert all(r["health"] in ("ok", "unknown") for r in loaded), [(r["name"], r.get("lastError")) for r in loaded]
    assert not [r["name"] for r in loaded if r["state"] == "firing"]  # a healthy stack pages no one


def test_the_scrape_saw_the_job(prom: prometheus.Prometheus, job: float) -> None:
    generated = prom.query("sum(increase(moe_lightning_generation_tokens_total[1m]))", at=job)
    assert float(generated[0]["value"][1]) >= 8 * 12
    streamed = prom.query("sum(moe_lightning_expert_bytes_streamed_total)", at=job)
    assert float(streamed[0]["value"][1]) > 0  # the budget streams experts: the copy panels are real
    serving = prom.query("moe_lightning_serving", at=job)
    assert {s["metric"]["job"]: s["value"][1] for s in serving} == dict.fromkeys(JOB_NAMES - {"gateway"}, "1")


# ---- the pipeline picture, live -----------------------------------------------------------------------
def _get(stack: Stack, path: str) -> tuple[int, str, bytes]:
    url = f"http://127.0.0.1:{stack.metrics_ports['orchestrator']}{path}"
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def test_debug_pages_serve_the_last_steps(stack: Stack, job: float) -> None:
    status, kind, body = _get(stack, "/debug/trace.json?steps=2")
    assert (status, kind) == (200, "application/json"), body
    trace = json.loads(body)["traceEvents"]
    lanes = {e["args"]["name"] for e in trace if e["ph"] == "M"}
    assert lanes == {"device", "cpu", "copy"}  # gpu_expert's compute and copies, cpu_attention's attention
    spans = [e for e in trace if e["ph"] == "X"]
    assert len({e["args"]["step"] for e in spans if e["args"]["step"] >= 0}) == 2
    assert {e["args"]["service"] for e in spans} == {"gpu_expert", "cpu_attention"}
    for page in ("/debug/timeline.png", "/debug/roofline.png"):
        status, kind, body = _get(stack, page)
        assert (status, kind) == (200, "image/png"), body[:300]
        assert body.startswith(b"\x89PNG\r\n\x1a\n") and len(body) > 5000
    status, _, body = _get(stack, "/debug/trace.json?steps=0")
    assert status == 400 and b"steps" in body
    status, _, _ = _get(stack, "/metrics")
    assert status == 200
