"""End to end with experts streaming through the double buffer, the timeline, and the overlap-off
baseline schedule: exact against transformers all the same."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.launcher import Stack
from moe_lightning.spec import ModelSpec

from reference import E2E_PROMPTS as PROMPTS
from reference import device_budget


def streaming_budget(model: Path, resident_per_layer: int = 1) -> int:
    """Dense weights, `resident_per_layer` experts of every layer and a double buffer for the rest."""
    spec = ModelSpec.from_pretrained(model)
    return device_budget(model, 2 * (spec.num_experts - resident_per_layer), resident_per_layer)


@pytest.fixture(scope="module")
def streaming_stack(
    hf_dir: Path, make_module_stack: Callable[..., Stack], tmp_path_factory: pytest.TempPathFactory
) -> Stack:
    """The same model with a device budget that holds 1 of 6 experts per layer: the rest stream."""
    budget = streaming_budget(hf_dir)
    timelines = tmp_path_factory.mktemp("timeline")
    s = make_module_stack(
        micro_batch_size=3,
        device_memory=str(budget),
        experts_placement="gpu",  # on a CPU the HRM would compute them in place (zero copy)
        extra={  # hot-expert swaps while generating; stage times recorded for the timeline test
            "gpu_expert": ["--residency-interval", "2", "--timeline", str(timelines / "gpu_expert.jsonl")],
            "cpu_attention": ["--timeline", str(timelines / "cpu_attention.jsonl")],
        },
    )
    s.timeline_files = [timelines / "gpu_expert.jsonl", timelines / "cpu_attention.jsonl"]  # type: ignore[attr-defined]
    return s


def test_streamed_experts_keep_tokens_exact(streaming_stack: Stack, reference: dict) -> None:
    with GenerationClient(streaming_stack.api_address, timeout=120) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=14) for p in PROMPTS])
    assert [d.token_ids for d in done] == [reference[i] for i in range(len(PROMPTS))]
    with urllib.request.urlopen(streaming_stack.endpoints()["gpu_expert"]["metrics"], timeout=10) as r:
        text = r.read().decode()
    assert float(re.search(r"^moe_lightning_resident_experts (\S+)", text, re.M)[1]) == 3.0
    assert float(re.search(r"^moe_lightning_expert_bytes_streamed_total (\S+)", text, re.M)[1]) > 0
    assert 'moe_lightning_expert_routed_tokens_total{expert="' in text
    assert float(re.search(r"^moe_lightning_residency_changes_total (\S+)", text, re.M)[1]) >= 1


def test_a_budget_below_the_dense_weights_fails_at_start(make_stack: Callable[..., Stack]) -> None:
    from moe_lightning.launcher import StackError

    # no batch size: the launcher's default
    s = make_stack(kv_cache_memory="8MiB", max_batch_size=None, device_memory="64KiB", start=False)
    with pytest.raises(StackError, match="refused before start") as info:  # by the launcher: nothing started
        s.start(timeout=120)
    assert "cannot hold the dense weights" in str(info.value)
    assert all(p.poll() is not None for p in s.procs.values())
    assert s.leaked_segments() == []


def test_timeline_shows_attention_and_copies_overlapping_device_work(streaming_stack: Stack, tmp_path: Path) -> None:
    """Runs after the streaming generation above: CPU attention of one micro-batch runs while the
    device computes another, and expert page copies run during device compute."""
    import json
    import subprocess
    import sys

    import pyarrow.parquet as pq

    from moe_lightning.timeline import load, summarize

    with GenerationClient(streaming_stack.api_address, timeout=120) as c:  # make sure there is a run to see
        c.batch_generate([Prompt(token_ids=p, max_new_tokens=6, ignore_eos=True) for p in PROMPTS[:7]])
    events = load(streaming_stack.timeline_files)  # type: ignore[attr-defined]
    assert {e.resource for e in events} == {"device", "cpu", "copy"}
    assert {e.micro_batch for e in events if e.resource == "cpu"} >= {0, 1, 2}
    summary = summarize(events)
    assert summary["overlap_seconds"]["cpu&device"] > 0
    # CGOPipe's order across layers: attention of (l+1, m) starts before the device finishes
    # post-attention of (l, m+1) -- no barrier at the layer boundary
    attention = {(e.step, e.layer, e.micro_batch): e for e in events if e.resource == "cpu"}
    post = {(e.step, e.layer, e.micro_batch): e for e in events if e.stage == "post_attention"}
    crossing = [
        (step, layer, m)
        for (step, layer, m), a in attention.items()
        if layer > 0 and (step, layer - 1, m + 1) in post and a.start_ns < post[(step, layer - 1, m + 1)].end_ns
    ]
    assert crossing, "no attention of layer l+1 ran during the device's work on layer l"
    assert summary["overlap_seconds"]["copy&device"] > 0
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_lightning.cli",
            "timeline",
            *map(str, streaming_stack.timeline_files),  # type: ignore[attr-defined]
            "--chrome",
            str(tmp_path / "trace.json"),
            "--parquet",
            str(tmp_path / "t.parquet"),
            "--png",
            str(tmp_path / "t.png"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout)["busy_fraction"]) == {"device", "cpu", "copy"}
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert any(e.get("ph") == "X" and e["name"].startswith("attention") for e in trace)
    assert pq.read_table(tmp_path / "t.parquet").num_rows == len(events)
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_overlap_off_baseline_is_exact_and_sequential(
    hf_dir: Path, reference: dict, tmp_path: Path, make_stack: Callable[..., Stack]
) -> None:
    """The FlexGen-style baseline schedule (--no-overlap): same tokens, and the timeline shows no stage
    of one resource running while another works."""
    from moe_lightning.timeline import load, summarize

    files = [tmp_path / "gpu.jsonl", tmp_path / "cpu.jsonl"]
    s = make_stack(
        micro_batch_size=3,
        device_memory=str(streaming_budget(hf_dir)),
        experts_placement="gpu",
        extra={
            "gpu_expert": ["--no-overlap", "--timeline", str(files[0])],
            "cpu_attention": ["--timeline", str(files[1])],
        },
    )
    with GenerationClient(s.api_address, timeout=120) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=14) for p in PROMPTS])
    s.stop()
    assert [d.token_ids for d in done] == [reference[i] for i in range(len(PROMPTS))]
    summary = summarize(load(files))
    busy = summary["busy_fraction"]
    assert "copy" in busy  # the budget holds 1 expert per layer: the rest stream
    overlap = summary["overlap_seconds"]
    assert overlap["cpu&device"] < 0.02 * summary["span_seconds"]
    assert overlap["copy&device"] < 0.02 * summary["span_seconds"]
