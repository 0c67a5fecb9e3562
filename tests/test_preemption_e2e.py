"""KV by need through real processes: a cache far smaller than the batch's contexts preempts, and
the outputs stay transformers' (greedy) and each seed's own (sampled); 3,000 sequences through a
cache a tenth their size leave every block free (docs/kv-cache.md)."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from test_exactness import CONFIGS
from test_exactness import PROMPTS as EXACTNESS_PROMPTS

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.kv_format import bytes_per_token
from moe_lightning.launcher import Stack
from moe_lightning.spec import ModelSpec

from reference import E2E_PROMPTS, device_budget, hf_generate, load_hf, save_hf_mixtral

NEW_TOKENS = 14
BLOCK = 4  # small blocks: sequences cross many, so growth (and preemption) happens every few steps


def kv_bytes(model: Path, tokens: int) -> int:
    spec = ModelSpec.from_pretrained(model)
    return tokens * bytes_per_token("float32", spec.num_layers, spec.num_kv_heads, spec.head_dim)


def metric(stack: Stack, service: str, name: str) -> float:
    text = urllib.request.urlopen(stack.endpoints()[service]["metrics"], timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    assert m is not None, f"{name} not in {service}'s metrics"
    return float(m[1])


def tight_stack(make_stack: Callable[..., Stack], model: Path, tokens: int, **overrides: object) -> Stack:
    return make_stack(
        **{
            "model": model,
            "kv_cache_memory": kv_bytes(model, tokens),
            "max_batch_size": 64,
            "extra": {"cpu_attention": ["--block-size", str(BLOCK)]},
            **overrides,
        }
    )


@pytest.fixture(scope="module", params=["e2e", *CONFIGS])
def checkpoint(request: pytest.FixtureRequest, hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "e2e":
        return hf_dir
    return save_hf_mixtral(tmp_path_factory.mktemp(request.param), seed=1, **CONFIGS[request.param])


def test_greedy_through_a_cache_that_preempts_matches_transformers(
    checkpoint: Path, make_stack: Callable[..., Stack]
) -> None:
    prompts = E2E_PROMPTS if checkpoint.name.startswith("hf_e2e") else EXACTNESS_PROMPTS
    expected = hf_generate(load_hf(checkpoint), prompts, NEW_TOKENS)
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    stack = tight_stack(make_stack, checkpoint, 2 * longest)  # the batch's contexts need ~10x this
    with GenerationClient(stack.api_address, timeout=300) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=NEW_TOKENS) for p in prompts])
    assert [d.token_ids for d in done] == expected
    assert metric(stack, "orchestrator", "moe_lightning_preemptions_total") > 0
    assert metric(stack, "orchestrator", "moe_lightning_recomputed_tokens_total") > 0


def test_attention_on_the_device_preempts_in_its_own_cache_and_stays_exact(
    hf_dir: Path, reference: dict, make_stack: Callable[..., Stack]
) -> None:
    kv = kv_bytes(hf_dir, 2 * (max(len(p) for p in E2E_PROMPTS) + NEW_TOKENS))  # gpu_expert's KV cache
    stack = make_stack(
        device_memory=str(device_budget(hf_dir, 7) + kv),
        device_kv_memory=str(kv),
        attention_placement="gpu",
        experts_placement="gpu",
        max_batch_size=64,
        extra={"gpu_expert": ["--block-size", str(BLOCK)]},
    )
    with GenerationClient(stack.api_address, timeout=300) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=NEW_TOKENS) for p in E2E_PROMPTS])
    assert [d.token_ids for d in done] == [reference[i] for i in range(len(E2E_PROMPTS))]
    assert metric(stack, "orchestrator", "moe_lightning_preemptions_total") > 0
    assert sum(d.preemptions for d in done) == metric(stack, "orchestrator", "moe_lightning_preemptions_total")


def test_a_sampled_sequence_keeps_its_seeds_stream_across_preemptions(
    hf_dir: Path, make_stack: Callable[..., Stack]
) -> None:
    rows = [
        Prompt(token_ids=p, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=100 + i) for i, p in enumerate(E2E_PROMPTS)
    ]
    longest = max(len(p) for p in E2E_PROMPTS) + NEW_TOKENS
    stack = tight_stack(make_stack, hf_dir, 2 * longest)
    with GenerationClient(stack.api_address, timeout=300) as c:
        alone = [c.generate(r).token_ids for r in rows]  # one at a time: each fits, nothing is preempted
        assert metric(stack, "orchestrator", "moe_lightning_preemptions_total") == 0
        together = [d.token_ids for d in c.batch_generate(rows)]
    assert metric(stack, "orchestrator", "moe_lightning_preemptions_total") > 0
    assert together == alone
    assert len({tuple(t) for t in alone}) > 1  # sampled, not one greedy answer


def test_three_thousand_sequences_through_a_tenth_of_their_cache_leave_no_block_behind(
    tiny_model: Path, make_stack: Callable[..., Stack]
) -> None:
    prompts = [[1, *(5 + (i * 7 + j) % 50 for j in range(3 + i % 6))] for i in range(3000)]
    max_new = [4 + i % 9 for i in range(3000)]
    need = sum(len(p) + n for p, n in zip(prompts, max_new, strict=True))
    stack = tight_stack(make_stack, tiny_model, need // 10, max_batch_size=512)
    rows = [Prompt(token_ids=p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, max_new, strict=True)]
    with GenerationClient(stack.api_address, timeout=600) as c:
        done = c.batch_generate_all(rows, chunk_size=500)
    assert [len(d.token_ids) for d in done] == max_new
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for p, d in zip(prompts, done, strict=True):  # the same prompt, preempted or not: the same greedy tokens
        first = by_prompt.setdefault(tuple(p), d.token_ids)
        assert d.token_ids[: len(first)] == first[: len(d.token_ids)]
    assert metric(stack, "orchestrator", "moe_lightning_preemptions_total") > 0
    assert metric(stack, "orchestrator", "moe_lightning_kv_cache_usage_ratio") == 0
    deadline = time.monotonic() + 10  # the workers drop the last finished with a release of their own
    while metric(stack, "cpu_attention", 'moe_lightning_kv_cache_blocks{state="used"}') and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(stack, "cpu_attention", 'moe_lightning_kv_cache_blocks{state="used"}') == 0


def test_a_jobs_summary_counts_its_preemptions(tiny_model: Path, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from processes import cli

    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(pa.table({"prompt_ids": [[1, *range(5 + i, 25 + i)] for i in range(24)]}), src)
    job = ["run", "--model", str(tiny_model), "--input", str(src), "--no-progress", "--max-new-tokens", "40"]
    tight = ["--kv-cache-memory", str(kv_bytes(tiny_model, 256)), "--max-batch-size", "24", "--ignore-eos"]
    r = cli(*job, "--output", str(out), *tight)
    assert r.returncode == 0, r.stderr
    m = re.search(r"; (\d+) preemptions \((\d+) prompts re-prefilled", r.stderr)
    assert m is not None and int(m[1]) > 0 and int(m[2]) > 0, r.stderr
    need = pq.read_table(out).column("token_ids").to_pylist()
    r = cli(*job, "--output", str(out), "--overwrite", *tight, "--kv-admission", "reserve")
    assert r.returncode == 0, r.stderr
    assert "; 0 preemptions (0 prompts" in r.stderr
    assert pq.read_table(out).column("token_ids").to_pylist() == need  # greedy: the same either way
