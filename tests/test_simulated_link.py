"""The simulated host-device link of a CPU device (gpu_expert --link-bandwidth): the copy thread holds
each copy job to its bytes over the link's rate, one job after another, sleeping rather than spinning;
the HRM plans with that link; a stack behind it stays exact (docs/cgopipe-and-benchmarks.md, "The
link on the CPU")."""

from __future__ import annotations

import argparse
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from host_profile import HOST, SPEC

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.config.checks import link_flag_error
from moe_lightning.config.units import parse_rate
from moe_lightning.hrm.costmodel import Policy, estimate
from moe_lightning.hrm.hardware import PRESETS, with_simulated_link
from moe_lightning.hrm.layercost import Workload
from moe_lightning.launcher import Stack
from moe_lightning.timeline import TimelineRecorder
from services.gpu_expert.copy_engine import ThreadCopyEngine, make_copy_engine

from reference import E2E_PROMPTS, device_budget

MB = 1_000_000


def _pairs(nbytes: int, pages: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(pages)
    return [(torch.empty(nbytes // 4), torch.randn(nbytes // 4, generator=g)) for _ in range(pages)]


def test_a_copy_takes_its_bytes_over_the_link_rate_and_lands_exact() -> None:
    engine = ThreadCopyEngine(TimelineRecorder(None, "test"), link_bandwidth=20 * MB)
    try:
        pairs = _pairs(2 * MB, pages=2)  # 4 MB at 20 MB/s: 200 ms
        t0 = time.perf_counter()
        waited = engine.copy(pairs, layer=0).wait()
        wall = time.perf_counter() - t0
    finally:
        engine.close()
    assert 0.2 <= wall < 0.2 + 0.15 and waited >= 0.19
    assert all(torch.equal(dst, src) for dst, src in pairs)


def test_jobs_queue_on_the_one_link() -> None:
    """Two jobs issued together: the second ends a whole transfer after the first, as on one link."""
    engine = ThreadCopyEngine(TimelineRecorder(None, "test"), link_bandwidth=20 * MB)
    try:
        t0 = time.perf_counter()
        first, second = engine.copy(_pairs(2 * MB), 0), engine.copy(_pairs(2 * MB), 1)  # 100 ms each
        first.wait()
        t1 = time.perf_counter() - t0
        second.wait()
        t2 = time.perf_counter() - t0
    finally:
        engine.close()
    assert 0.1 <= t1 < 0.18 and 0.2 <= t2 < 0.3


def test_the_link_sleeps_out_its_time_instead_of_spinning() -> None:
    """A link-bound copy costs the process about its memcpy in CPU time, not its wall time: compute
    beside it keeps both cores."""
    engine = ThreadCopyEngine(TimelineRecorder(None, "test"), link_bandwidth=4 * MB)
    try:
        cpu0, t0 = time.process_time(), time.perf_counter()
        engine.copy(_pairs(2 * MB), 0).wait()  # 500 ms on the link, ~1 ms of memcpy
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    finally:
        engine.close()
    assert wall >= 0.5 and cpu < 0.1 * wall, (cpu, wall)


def test_the_timeline_shows_the_link_busy_for_the_transfer(tmp_path: Path) -> None:
    from moe_lightning.timeline import load

    path = tmp_path / "copies.jsonl"
    timeline = TimelineRecorder(str(path), "gpu_expert")
    engine = ThreadCopyEngine(timeline, link_bandwidth=20 * MB)
    try:
        engine.copy(_pairs(2 * MB), layer=3).wait()
    finally:
        engine.close()
        timeline.close()
    (span,) = [e for e in load([path]) if e.resource == "copy"]
    assert span.layer == 3 and 0.1 <= (span.end_ns - span.start_ns) / 1e9 < 0.18


def test_a_cuda_device_refuses_a_simulated_link() -> None:
    with pytest.raises(ValueError, match="simulates a host-device link for --device cpu"):
        make_copy_engine(torch.device("cuda", 0), TimelineRecorder(None, "test"), link_bandwidth=1e9)
    assert link_flag_error("cuda:1", 1e9) and link_flag_error("cpu", 1e9) is None
    assert link_flag_error("cuda", None) is None
    with pytest.raises(ValueError, match="must be positive"):
        ThreadCopyEngine(TimelineRecorder(None, "test"), link_bandwidth=0.0)


def test_rates_parse_as_links_are_quoted() -> None:
    assert parse_rate("2GB/s") == 2e9 and parse_rate("500MiB/s") == 500 * 2**20 and parse_rate("1.5e9") == 1.5e9
    for bad in ("0", "-1GB/s", "fast", "inf", "nan", "1e400"):
        with pytest.raises(argparse.ArgumentTypeError, match="bytes per second"):
            parse_rate(bad)


# --- the HRM behind a simulated link ---------------------------------------------------------------
def test_the_hrm_overlaps_a_simulated_link_with_compute_on_shared_cores() -> None:
    """Compute shares the cores (device and host times add); the link runs beside it: a layer takes
    the larger of the two, and the overlap-off schedule their sum."""
    work, policy = Workload(77, 32), Policy(256, 32, "cpu", "gpu", 0)
    plain = estimate(SPEC, work, HOST, policy, "float32")
    page = plain.page_bytes
    for rate in (2e8, 2e9, 2e10):
        est = estimate(SPEC, work, with_simulated_link(HOST, rate), policy, "float32")
        compute = est.resource_seconds["gpu"] + est.resource_seconds["cpu"]
        link = est.resource_seconds["link"]
        assert link == pytest.approx(SPEC.num_experts * page / rate)  # every expert of the layer streams
        assert est.link_bytes == {"link_weights": SPEC.num_experts * page}  # hand-offs stay in shared memory
        assert est.layer_seconds == max(compute, link)
        assert compute == pytest.approx(plain.layer_seconds)  # the compute is what it was without a link
        off = estimate(SPEC, work, with_simulated_link(HOST, rate), policy, "float32", overlap=False)
        assert off.layer_seconds == pytest.approx(compute + link)
    fast = estimate(SPEC, work, with_simulated_link(HOST, 1e13), policy, "float32")
    assert fast.binding != "link" and fast.layer_seconds == pytest.approx(plain.layer_seconds)
    slow = estimate(SPEC, work, with_simulated_link(HOST, 1e8), policy, "float32")
    assert slow.binding == "link"
    in_place = estimate(SPEC, work, with_simulated_link(HOST, 1e8), Policy(256, 32, "cpu", "cpu", 0), "float32")
    assert in_place.resource_seconds["link"] == 0  # experts computed where they live cross nothing
    with pytest.raises(ValueError, match="for a CPU device"):
        with_simulated_link(PRESETS["t4"], 1e9)


def test_overlap_off_adds_every_resource_on_a_gpu_box_too() -> None:
    from moe_lightning.hrm.archs import ARCHS

    spec, work, policy = ARCHS["mixtral-8x7b"], Workload(77, 32), Policy(512, 64, "cpu", "gpu", 32)
    on = estimate(spec, work, PRESETS["t4"], policy)
    off = estimate(spec, work, PRESETS["t4"], policy, overlap=False)
    assert off.layer_seconds == pytest.approx(sum(on.resource_seconds.values()))
    assert off.layer_seconds > on.layer_seconds and off.stage_seconds == on.stage_seconds


# --- a stack behind the link -------------------------------------------------------------------------
def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)[1])


def test_a_stack_behind_a_simulated_link_streams_at_its_rate_and_stays_exact(
    hf_dir: Path, make_stack: Callable[..., Stack], reference: dict
) -> None:
    rate = 10 * MB  # the model's 6 experts per layer (~0.44 MB) take ~44 ms a layer
    s = make_stack(
        micro_batch_size=3,
        device_memory=str(device_budget(hf_dir, 12)),  # a double buffer, nothing resident: every expert streams
        experts_placement="gpu",
        link_bandwidth=rate,
    )
    with GenerationClient(s.api_address, timeout=120) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=14) for p in E2E_PROMPTS])
    assert [d.token_ids for d in done] == [reference[i] for i in range(len(E2E_PROMPTS))]
    metrics = s.endpoints()["gpu_expert"]["metrics"]
    streamed = _metric(metrics, "moe_lightning_expert_bytes_streamed_total")
    busy = _metric(metrics, "moe_lightning_expert_copy_seconds_total")
    # every job waits out its bytes; the memcpy of these pages is far inside that time
    assert streamed > 0 and streamed / rate * 0.98 <= busy <= streamed / rate * 1.25 + 0.5
    assert _metric(metrics, 'moe_lightning_link_bandwidth_bytes_per_second{direction="h2d"}') == rate


def test_a_simulated_link_on_a_gpu_is_refused_before_anything_starts(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from moe_lightning.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n')
    job = ["--input", str(prompts), "--output", str(tmp_path / "o.parquet")]
    for command, extra in (("up", []), ("bench", []), ("run", job)):
        t0 = time.perf_counter()
        argv = [command, "--model", str(tiny_model), "--device", "cuda", "--link-bandwidth", "2GB/s", *extra]
        assert main(argv) == 2, command
        assert "--link-bandwidth simulates a host-device link" in capsys.readouterr().err, command
        assert time.perf_counter() - t0 < 5  # refused up front, not once gpu_expert starts
