"""Every placement the policy can pick (attention on the host or the device, non-resident experts
streamed to the device or computed where they live), through the real stack: greedy tokens still
equal transformers', and the metrics show the placement really ran."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.launcher import Stack

from reference import E2E_PROMPTS as PROMPTS
from reference import device_budget


def _metric(text: str, series: str) -> float:
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(m[1]) if m else 0.0


def _scrape(stack: Stack, service: str) -> str:
    with urllib.request.urlopen(stack.endpoints()[service]["metrics"], timeout=10) as r:
        return r.read().decode()


@pytest.mark.parametrize(
    ("attention", "experts"),
    [("cpu", "gpu"), ("cpu", "cpu"), ("gpu", "gpu"), ("gpu", "auto")],
)
def test_every_placement_is_exact(
    attention: str, experts: str, hf_dir: Path, reference: dict, make_stack: Callable[..., Stack]
) -> None:
    # 7 slots for 6 experts a layer: a ring of one layer plus one page, so the next layer's pages
    # mostly wait for the current layer's slots (the tightest streaming schedule)
    s = make_stack(
        micro_batch_size=3,
        device_memory=str(device_budget(hf_dir, 7) + (8 << 20 if attention == "gpu" else 0)),
        device_kv_memory="8MiB" if attention == "gpu" else None,
        attention_placement=attention,
        experts_placement=experts,
    )
    with GenerationClient(s.api_address, timeout=120) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=14) for p in PROMPTS])
    gpu, cpu, orch = (_scrape(s, n) for n in ("gpu_expert", "cpu_attention", "orchestrator"))
    s.stop()
    assert [d.token_ids for d in done] == [reference[i] for i in range(len(PROMPTS))]
    assert _metric(gpu, "moe_lightning_resident_experts") == 0.0
    streamed = _metric(gpu, "moe_lightning_expert_bytes_streamed_total")
    # auto on a CPU-only machine: host and device are one memory, so the HRM computes the experts in
    # place rather than copy them (the zero-copy mode)
    on_host = experts in ("cpu", "auto")
    assert (streamed == 0) == on_host
    assert f'experts="{"cpu" if on_host else "gpu"}"' in orch and f'attention="{attention}"' in orch
    handoffs = _metric(cpu, 'moe_lightning_handoffs_total{direction="in"}')
    assert (handoffs == 0) == (attention == "gpu")


def test_a_placement_the_services_cannot_run_fails_at_start(make_stack: Callable[..., Stack]) -> None:
    from moe_lightning.launcher import StackError

    # the launcher's own KV cache and batch size
    s = make_stack(kv_cache_memory="2GiB", max_batch_size=None, attention_placement="gpu", start=False)
    with pytest.raises(StackError, match="refused before start") as info:  # by the launcher: nothing started
        s.start(timeout=120)
    assert s.procs == {}
    assert "placement 'gpu' is not available: gpu_expert has no device KV cache" in str(info.value)
    assert s.leaked_segments() == []
