"""The native decode attention kernel (moe_lightning/native) against the PyTorch path it replaces: ragged
batches, every cache format, sliding windows, sinks, freed blocks behind a window; and the PyTorch path
where it cannot build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moe_lightning import native
from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.native import decode_kernel
from moe_lightning.spec import ModelSpec
from moe_lightning.stages.attend import plan_batch
from moe_lightning.stages.attention import paged_attention, plan_attention, write_kv

needs_kernel = pytest.mark.skipif(decode_kernel() is None, reason="the native kernel did not build here")
SHAPES = {
    "bench 16/4/64": (16, 4, 64),
    "mixtral 32/8/128": (32, 8, 128),
    "mha 4/4/32": (4, 4, 32),
    "g8 8/1/16": (8, 1, 16),
}


def _spec(heads: int, kv_heads: int, head_dim: int, **kw: object) -> ModelSpec:
    return replace(ModelSpec("MixtralForCausalLM", 32, 16, 1, heads, kv_heads, head_dim, 2, 1, 400), **kw)


def _ragged_cache(spec: ModelSpec, fmt: torch.dtype | str, contexts: list[int], block_size: int) -> PagedKVCache:
    cache = PagedKVCache(spec, sum(-(-c // block_size) for c in contexts) + 8, block_size, fmt, shuffle_seed=3)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(sum(contexts), spec.num_kv_heads, spec.head_dim, generator=gen)
    v = torch.randn(sum(contexts), spec.num_kv_heads, spec.head_dim, generator=gen)
    # the prompt but its last token (which the decode step appends); a one-token context has none
    seqs = [s for s, c in enumerate(contexts) if c > 1]
    meta = cache.append(seqs, [contexts[s] - 1 for s in seqs])
    write_kv(*cache.layer(0), k[: meta.num_tokens], v[: meta.num_tokens], meta.slot_mapping())
    return cache


@needs_kernel
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("fmt", [torch.float32, torch.bfloat16, torch.float16, "int8"], ids=str)
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("sinks", [False, True])
def test_the_kernel_is_the_pytorch_path_to_fp32_rounding(
    shape: str, fmt: object, window: int | None, sinks: bool
) -> None:
    spec = _spec(*SHAPES[shape], sliding_window=window)
    contexts = [1, 2, 15, 16, 17, 100, 333, 64, 5]  # ragged: within a block, at its edges, many blocks
    cache = _ragged_cache(spec, fmt, contexts, 16)
    meta = cache.append(list(range(len(contexts))), [1] * len(contexts))
    k_new = torch.randn(len(contexts), spec.num_kv_heads, spec.head_dim)
    write_kv(*cache.layer(0), k_new, -k_new, meta.slot_mapping())
    plan = plan_attention(meta, window)
    assert plan.native is not None
    q = torch.randn(len(contexts), spec.num_heads, spec.head_dim, generator=torch.Generator().manual_seed(1))
    sink = torch.randn(spec.num_heads) * 2 if sinks else None
    got = paged_attention(q, *cache.layer(0), plan, sink)
    want = paged_attention(q, *cache.layer(0), replace(plan, native=None), sink)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


@needs_kernel
def test_blocks_freed_behind_a_window_are_never_read() -> None:
    """GPT-OSS's layout: the sliding group's freed entries are -1 in its tables; the kernel starts at
    the window and gives what the PyTorch path gives."""
    spec = _spec(8, 2, 16, num_layers=2, sliding_window=8, sliding_layers=(0,))
    cache = PagedKVCache(spec, 400, 4, torch.bfloat16, shuffle_seed=0)
    cache.k.normal_()
    cache.v.normal_()
    seqs = [0, 1, 2]
    cache.append(seqs, [50, 9, 30])
    for _ in range(5):
        meta = cache.append(seqs, [1, 1, 1])
    sliding = cache.layout.layer_group[0]
    assert cache.freed_behind_windows > 0 and -1 in meta.group(sliding).block_tables[0]
    plans = plan_batch(spec, meta)
    q = torch.randn(3, 8, 16)
    for layer in range(2):
        got = paged_attention(q, *cache.layer(layer), plans[layer])
        want = paged_attention(q, *cache.layer(layer), replace(plans[layer], native=None))
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("heads", [(4, 4, 8), (34, 2, 16)], ids=["head dim 8", "17 query heads a KV head"])
def test_heads_the_kernel_does_not_take_run_the_pytorch_path(heads: tuple[int, int, int]) -> None:
    spec = _spec(*heads)
    cache = _ragged_cache(spec, torch.float32, [9, 40], 16)
    plan = plan_attention(cache.append([0, 1], [1, 1]))
    assert plan.native is not None and not native.fits_decode_kernel(*heads)
    q = torch.randn(2, spec.num_heads, spec.head_dim)
    got = paged_attention(q, *cache.layer(0), plan)
    torch.testing.assert_close(got, paged_attention(q, *cache.layer(0), replace(plan, native=None)))


def test_where_it_cannot_build_the_pytorch_path_runs_and_says_so(tmp_path: Path) -> None:
    """A compiler that fails (as on a machine without one): the build is refused, logged, and attention
    still runs; MOE_LIGHTNING_NATIVE=0 turns it off without trying."""
    script = (
        "import torch\n"
        "from moe_lightning.native import decode_kernel\n"
        "from moe_lightning.kv_cache import PagedKVCache\n"
        "from moe_lightning.spec import ModelSpec\n"
        "from moe_lightning.stages.attention import paged_attention, plan_attention\n"
        "assert decode_kernel() is None\n"
        "spec = ModelSpec('MixtralForCausalLM', 32, 16, 1, 4, 2, 16, 2, 1, 400)\n"
        "cache = PagedKVCache(spec, 8, 4)\n"
        "meta = cache.append([0], [5])\n"
        "plan = plan_attention(cache.append([0], [1]))\n"
        "assert plan.native is None\n"
        "print(paged_attention(torch.randn(1, 4, 16), *cache.layer(0), plan).shape)\n"
    )
    for extra in ({"CXX": "/bin/false"}, {"MOE_LIGHTNING_NATIVE": "0"}):
        env = {**os.environ, "MOE_LIGHTNING_NATIVE_DIR": str(tmp_path / next(iter(extra))), **extra}
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert "decode_attention=pytorch" in done.stdout + done.stderr


def test_the_benchmark_reports_each_case_beside_the_read_roof(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    bench = Path(__file__).resolve().parent.parent / "bench" / "kv_attention.py"
    args = ["--repeats", "1", "--batches", "16", "--contexts", "512", "--shapes", "bench-model 16/4/64"]
    done = subprocess.run(
        [sys.executable, str(bench), *args, "--json", str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["read_roof_gbps"] > 0 and report["native"] == (decode_kernel() is not None)
    (case,) = report["cases"]
    assert all(v["best_gbps"] > 0 for v in case["variants"].values())
    assert ("(g) native bf16" in case["variants"]) == report["native"]
    assert "share of the read roof" in done.stdout or not report["native"]
    if report["native"]:  # the kernels' own ceiling, their KV in the caches, beside the roof
        (rates,) = report["in_cache_gbps"].values()
        assert set(rates) == {"(f) native fp32", "(g) native bf16"} and all(r > 0 for r in rates.values())
        assert "the kernel's ceiling on this CPU" in done.stdout
