"""Benchmark building blocks: the MT-Bench-shaped workload, one batch through a fresh stack with its
metrics diffed around it, and transformers' `generate` as the baseline (bench-only: transformers
is never needed to serve)."""

from __future__ import annotations

import math
import re
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_lightning.client import Completion, GenerationClient, Prompt
from moe_lightning.config.stack import StackConfig
from moe_lightning.hrm.costmodel import Policy
from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.launcher import Stack
from moe_lightning.private_paths import private_dir
from moe_lightning.spec import ModelSpec
from moe_lightning.step_protocol import StepKind, StepTimings
from moe_lightning.validation import MAX_BATCH_PROMPTS

SERVICES = ("orchestrator", "gpu_expert", "cpu_attention")
KV_BLOCK_SIZE = 16  # cpu_attention's --block-size default: the unit the orchestrator reserves KV in
KV_MARGIN = 1.25  # beyond the batch's own reservations: a safety margin, should admission ever reserve more
KV_FLOOR_BLOCKS = 64  # a tiny batch (tests, the check's dry run) still gets a few sequences' worth of room


def kv_cache_bytes(
    spec: ModelSpec, prompt_lengths: Sequence[int], gen: int, kv_dtype: str, block_size: int = KV_BLOCK_SIZE
) -> int:
    """cpu_attention's --kv-cache-memory for a batch that runs all at once: the blocks the orchestrator
    reserves at admission (each sequence's prompt + gen rounded up to blocks, validation.blocks_needed),
    with a margin and a floor, in whole blocks of the size cpu_attention divides the budget by
    (PagedKVCache.blocks_in). 64 MT-Bench prompts and 32 new tokens of a 4-layer Mixtral in bf16 need
    0.14 GiB, where a fixed 4 GiB cost /dev/shm room the weight arena needs (bench/gpucheck/budget.py)."""
    blocks = sum(-(-(n + gen) // block_size) for n in prompt_lengths)
    blocks = max(KV_FLOOR_BLOCKS, math.ceil(blocks * KV_MARGIN))
    return blocks * PagedKVCache.bytes_per_block(spec, block_size, kv_dtype)  # by kv_format name: int8 too


def bench_log_prefix(run_id: str) -> str:
    """The name a bench stack's service-log directory starts with: a private mkdtemp directory
    (`moe_lightning.launcher.private_dir`) whose name goes on with random characters."""
    return f"moe-lightning-bench-{run_id}-"


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m[1]] = float(m[2])
    return out


def random_prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[1, *torch.randint(3, vocab, (prompt_len - 1,), generator=g).tolist()] for _ in range(batch)]


@dataclass
class StackRun:
    done: list[Completion]
    wall_seconds: float
    delta: Callable[[str, str], float]  # (service, series) -> increase during the batch
    after: dict[str, dict[str, float]]  # every service's metrics after the batch

    def policy(self) -> dict[str, str]:
        """The orchestrator's policy in force at the end (its moe_lightning_policy_info labels)."""
        for key in self.after["orchestrator"]:
            if key.startswith("moe_lightning_policy_info{"):
                return dict(re.findall(r'(\w+)="([^"]*)"', key))
        return {}


def run_batch(
    model: Path,
    batch: list[list[int]],
    gen: int,
    run_id: str,
    threads: int = 0,
    extra: dict[str, list[str]] | None = None,
    device_memory: str | None = None,
    micro_batch: int | None = None,
    **stack: object,
) -> StackRun:
    """`stack`: more StackConfig fields (device, dtype, placements, device_kv_memory); without a
    kv_cache_memory, the KV cache is sized to hold the whole batch (kv_cache_bytes)."""
    cfg = StackConfig(
        model=model,
        run_id=run_id,
        port=0,
        max_batch_size=len(batch),
        log_dir=private_dir(prefix=bench_log_prefix(run_id)),  # found again by bench/gpucheck/processes.py
        cache_dir=model.parent / "arena-cache",
        threads={"gpu_expert": threads, "cpu_attention": threads} if threads else {},
        extra=extra or {},
        device_memory=device_memory,
        micro_batch_size=micro_batch,
        **stack,  # type: ignore[arg-type]
    )
    s = Stack(cfg)
    if "kv_cache_memory" not in stack:
        kv_dtype = cfg.kv_dtype if cfg.kv_dtype != "auto" else s.weight_dtype()  # auto: the arena's, as cpu_attention
        spec = ModelSpec.from_pretrained(model)
        cfg.kv_cache_memory = int(kv_cache_bytes(spec, [len(p) for p in batch], gen, kv_dtype))
    s.start()
    try:
        ep = s.endpoints()
        _wait_for_arena_copy(ep["weight_store"]["metrics"])
        with GenerationClient(s.api_address, timeout=3600) as c:
            c.batch_generate([Prompt(token_ids=batch[0][:8], max_new_tokens=2, ignore_eos=True)])  # warm-up
            before = {n: scrape(ep[n]["metrics"]) for n in SERVICES}
            prompts = [Prompt(token_ids=p, max_new_tokens=gen, ignore_eos=True) for p in batch]
            # every prompt in flight at once, in calls of the most one takes: the batch is the whole set
            # (a BatchGenerate takes at most MAX_BATCH_PROMPTS; the queue holds the batch and two calls)
            calls = -(-len(prompts) // MAX_BATCH_PROMPTS)
            t0 = time.perf_counter()
            done = c.batch_generate_all(prompts, chunk_size=MAX_BATCH_PROMPTS, in_flight=calls)
            wall = time.perf_counter() - t0
            after = {n: scrape(ep[n]["metrics"]) for n in SERVICES}
    finally:
        s.stop()
    return StackRun(done, wall, lambda svc, key: after[svc].get(key, 0.0) - before[svc].get(key, 0.0), after)


def _wait_for_arena_copy(metrics_url: str, timeout: float = 900.0) -> None:
    """The weight store writes its converted copy to disk after it is serving; that read of the whole
    arena competes with the stack for memory bandwidth, so nothing is measured until it is done."""
    deadline = time.monotonic() + timeout
    while scrape(metrics_url).get("moe_lightning_arena_copy_pending", 0.0) and time.monotonic() < deadline:
        time.sleep(0.5)


def mtbench_lengths(n: int, seed: int = 0, mean: float = 77.0, longest: int = 418, shortest: int = 4) -> list[int]:
    """Prompt lengths shaped like MT-Bench's (average 77, max 418 tokens): a seeded log-normal, clipped,
    rescaled to the published mean, with the longest prompt present once n is large enough."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(n, generator=g) * 0.75)
    lengths = (raw / raw.mean() * mean).clamp(shortest, longest)
    if n >= 16:  # the longest prompt is there once; the others shrink so the mean stays put
        i = int(torch.randint(n, (1,), generator=g))
        rest = torch.cat([lengths[:i], lengths[i + 1 :]])
        rest = (rest * (mean * n - longest) / rest.sum()).clamp(shortest, longest)
        lengths = torch.cat([rest[:i], torch.tensor([float(longest)]), rest[i:]])
    return [int(x) for x in lengths.round().long().tolist()]


def left_pad(prompts: list[list[int]], device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask), each (B, longest prompt): the padding a batched `generate` needs."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def transformers_generate(
    model: Path, prompts: list[list[int]], gen: int, device: str = "cpu", dtype: str = "float32"
) -> dict[str, float]:
    """transformers' own generate on the same checkpoint and batch: left padding to the longest prompt,
    sdpa attention, its default (grouped) experts path, exactly `gen` new tokens each; the whole
    model on `device` (on a GPU too small for it, use accelerate offloading instead)."""
    import time

    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    m = m.to(device).eval()
    ids, mask = left_pad(prompts, device)
    width = ids.shape[1]
    with torch.no_grad():
        m.generate(ids[:1, -4:], attention_mask=mask[:1, -4:], max_new_tokens=2, do_sample=False, pad_token_id=0)
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = m.generate(
            ids, attention_mask=mask, max_new_tokens=gen, min_new_tokens=gen, do_sample=False, pad_token_id=0
        )
        if device != "cpu":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    generated = (out.shape[1] - width) * len(prompts)
    return {"generated_tokens_per_second": generated / wall, "seconds": wall, "padded_width": width}


def policy_that_ran(policy: dict[str, str], resident_experts: float, sequences: int, micro_batch: int | None) -> Policy:
    """The cost model's Policy for a batch of `sequences`: the orchestrator's policy labels
    (`StackRun.policy()`), gpu_expert's resident experts, and the operator's micro-batch size when
    fixed (else the policy's); the last micro-batch is modelled as full."""
    mu = micro_batch or min(int(policy.get("micro_batch_size") or sequences), sequences)
    return Policy(
        -(-sequences // mu) * mu,
        mu,
        policy.get("attention", "cpu"),
        policy.get("experts", "gpu"),
        int(resident_experts),
        expert_groups=int(policy.get("expert_groups") or 0),
    )


@dataclass
class DecodeTotals:
    """A batch's decoding as the HRM comparison (moe_lightning/hrm/stage_accuracy.py) and decode tok/s
    read it: every step that decoded, whatever its kind (docs/cgopipe-and-benchmarks.md, "Decode time")."""

    steps: float  # steps that decoded: decode steps and mixed ones
    timings: StepTimings  # gpu_expert's timings over them, a mixed step's scaled by its decode share
    tokens: float = 0.0  # decode rows (a token each), every step kind
    seconds: float = 0.0  # the orchestrator's step wall time charged to decoding, every step kind
    by_kind: dict[str, dict[str, float]] = field(default_factory=dict)  # kind -> steps, tokens, seconds

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def seconds_by_stage(self) -> dict[str, float]:
        """Stage -> seconds (the JSON's decode_stage_seconds); "cpu_attention" is the attention
        service's compute in these steps, as its replies reported it (attention_busy)."""
        out = {stage: ns / 1e9 for stage, ns in self.timings.stages().items()}
        out["cpu_attention"] = self.timings.attention_busy / 1e9
        return out


DECODING_KINDS = (StepKind.DECODE, StepKind.MIXED)


def decode_totals(run: StackRun) -> DecodeTotals:
    """The batch's decoding, from the orchestrator's metrics around it: decode steps whole, mixed steps
    at the share of their time charged to their decode rows (StepTimings.decode / step)."""
    d = run.delta
    timings = StepTimings(StepKind.DECODE)
    totals = DecodeTotals(0.0, timings)
    for kind in DECODING_KINDS:

        def stage(name: str, kind: StepKind = kind) -> float:
            return d("orchestrator", f'moe_lightning_stage_seconds_total{{kind="{kind}",stage="{name}"}}')

        step = stage("step")
        share = 1.0 if kind is StepKind.DECODE else (stage("decode") / step if step else 0.0)
        for name in timings.stages():
            timings.add(name, round(stage(name) * share * 1e9))
        steps = d("orchestrator", f'moe_lightning_step_seconds_count{{kind="{kind}"}}')
        tokens = d("orchestrator", f'moe_lightning_decode_tokens_total{{kind="{kind}"}}')
        seconds = d("orchestrator", f'moe_lightning_decode_seconds_total{{kind="{kind}"}}')
        totals.steps += steps
        totals.tokens += tokens
        totals.seconds += seconds
        totals.by_kind[kind.value] = {"steps": steps, "tokens": tokens, "seconds": seconds, "share": share}
    return totals
