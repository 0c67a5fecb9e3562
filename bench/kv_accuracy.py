"""What an 8-bit host KV cache costs in accuracy and buys in speed (docs/kv-cache.md).

For the exactness checkpoints (the tiny transformers models the tests build, rebuilt here from the same
configs and seeds) and the demo bench model, greedy generation of --tokens tokens with the KV cache in
float32 (the reference), bfloat16 and int8 (and, with --fp8, fp8 e4m3 with and without a scale per
token per KV head, simulated: K/V rounded through float8_e4m3fn into an fp32 cache). Weights stay fp32,
so the cache's format is the only difference. Per model and format:

* greedy agreement: the fraction of the reference's tokens generated before the first divergence, and
  the fraction identical position by position over the whole run (free running: after a divergence the
  two texts go their own ways, so this one is only indicative);
* teacher forced (the reference's tokens fed back): the max |logit error| over every step and sequence
  (and over max |logit|), and top-1 agreement;
* at the last step, every layer's decode attention output over the format's copy of the reference's cache
  against fp32 (relative L2 error, the worst layer).

Then the speed line: decode attention ms per step (all layers, --speed-batch sequences) at a few context
lengths of the bench model's shape, float32 vs bfloat16 vs int8 caches, fp32 q (a CPU stack's weights),
on --threads torch threads (default 1: on a shared 2-core VM a second thread waits on a busy core and
the times swing 50x); for fp8, the cost of its dequantization alone (torch converts float8 on a CPU
element by element).

    python bench/kv_accuracy.py [--tokens 256] [--fp8] [--models tiny,gqa4_top3,mha_top1_window,e2e,bench]
        [--bench-model models/demo-bench] [--contexts 512 2048 4096 8192] [--threads 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))  # the exactness checkpoints' configs

from moe_lightning.checkpoint import load_model_weights
from moe_lightning.demo_model import write_demo_model
from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.spec import ModelSpec
from moe_lightning.stages import (
    embed_tokens,
    head_logits,
    paged_attention,
    plan_attention,
    post_attention,
    pre_attention,
    write_kv,
)
from moe_lightning.stages.attention import AttentionMetadata
from moe_lightning.tokenizer import TextTokenizer
from moe_lightning.weights import ModelWeights

REFERENCE = "float32"
REAL = ("bfloat16", "int8")  # formats the cache implements
FP8 = ("fp8_e4m3", "fp8_e4m3_scaled")  # simulated (--fp8)
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value: a scaled head's absmax maps to it
EXACTNESS = ("tiny", "gqa4_top3", "mha_top1_window", "e2e")
BENCH_PROMPTS = 4  # examples/demo_prompts.jsonl's first ones


@dataclass
class Row:
    model: str
    format: str
    prefix_agreement: float  # free running: reference tokens matched before the first divergence
    overall_agreement: float  # free running: identical positions
    max_logit_error: float  # teacher forced
    relative_logit_error: float  # max_logit_error / max |reference logit|
    top1_agreement: float  # teacher forced
    attention_error: float  # last step, worst layer: |o - o_fp32| / |o_fp32|


def fp8_roundtrip(x: torch.Tensor, scaled: bool) -> torch.Tensor:
    """x rounded through float8_e4m3fn (saturating), optionally with an fp32 scale per row (absmax / 448)."""
    x = x.float()
    if not scaled:
        return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    s = x.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX
    return (x / s).to(torch.float8_e4m3fn).float() * s


def _store_fn(fmt: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """What a simulated format does to K/V before they go into its fp32 cache (the real ones: nothing)."""
    if fmt in FP8:
        return lambda x: fp8_roundtrip(x, fmt.endswith("scaled"))
    return lambda x: x


def _cache_dtype(fmt: str) -> str:
    return REFERENCE if fmt in FP8 else fmt


def forward(
    spec: ModelSpec,
    weights: ModelWeights,
    cache: PagedKVCache,
    tokens: torch.Tensor,
    meta: AttentionMetadata,
    store: Callable[[torch.Tensor], torch.Tensor],
    keep_q: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """engine.forward_step, with K/V passed through `store` (a simulated format) and each layer's q kept."""
    positions = meta.positions()
    plan = plan_attention(meta, spec.sliding_window)
    hidden = embed_tokens(weights.embed, tokens)
    for i, layer in enumerate(weights.layers):
        q, k, v = pre_attention(spec, layer, hidden, positions)
        if keep_q is not None:
            keep_q.append(q.clone())
        write_kv(cache.k[i], cache.v[i], store(k), store(v), plan.write_slots)
        hidden, _ = post_attention(spec, layer, hidden, paged_attention(q, cache.k[i], cache.v[i], plan))
    last = torch.tensor(meta.q_lens).cumsum(0) - 1
    return head_logits(spec, weights.final_norm, weights.lm_head, hidden[last])


@dataclass
class Run:
    tokens: list[list[int]]  # (B, steps)
    logits: list[torch.Tensor]  # steps x (B, V)
    cache: PagedKVCache
    last_q: list[torch.Tensor]  # per layer, the last step's (B, H, Hd)


@torch.inference_mode()
def generate(
    spec: ModelSpec, weights: ModelWeights, prompts: list[list[int]], steps: int, fmt: str, forced: Run | None = None
) -> Run:
    """Greedy decoding of every prompt at once over a cache of `fmt` (shuffled blocks); with `forced`,
    its tokens are fed back instead of ours (teacher forcing)."""
    block = 16
    blocks = sum(-(-(len(p) + steps) // block) for p in prompts)
    cache = PagedKVCache(spec, blocks, block, _cache_dtype(fmt), shuffle_seed=0)
    store = _store_fn(fmt)
    seqs = list(range(len(prompts)))
    meta = cache.append(seqs, [len(p) for p in prompts])
    logits = forward(spec, weights, cache, torch.tensor([t for p in prompts for t in p]), meta, store)
    out: list[list[int]] = [[] for _ in prompts]
    kept: list[torch.Tensor] = []
    last_q: list[torch.Tensor] = []
    for step in range(steps):
        kept.append(logits.float())
        nxt = logits.argmax(-1).tolist() if forced is None else [t[step] for t in forced.tokens]
        for row, t in zip(out, nxt, strict=True):
            row.append(int(t))
        if step == steps - 1:
            break
        meta = cache.append(seqs, [1] * len(prompts))
        last_q = []
        logits = forward(spec, weights, cache, torch.tensor(nxt), meta, store, last_q)
    return Run(out, kept, cache, last_q)


def _copy_cache(ref: PagedKVCache, spec: ModelSpec, fmt: str) -> PagedKVCache:
    """The reference's cache, its K/V stored again in `fmt` (same blocks, same tables)."""
    nb, bs = ref.allocator.num_blocks, ref.block_size
    cache = PagedKVCache(spec, nb, bs, _cache_dtype(fmt))
    cache.tables, cache.lengths = ref.tables, ref.lengths
    store = _store_fn(fmt)
    slots = torch.arange(nb * bs)
    for i in range(spec.num_layers):
        assert torch.is_tensor(ref.k) and torch.is_tensor(ref.v)
        k = ref.k[i].reshape(nb * bs, spec.num_kv_heads, spec.head_dim)
        v = ref.v[i].reshape(nb * bs, spec.num_kv_heads, spec.head_dim)
        write_kv(cache.k[i], cache.v[i], store(k), store(v), slots)
    return cache


@torch.inference_mode()
def attention_error(spec: ModelSpec, ref: Run, fmt: str) -> float:
    """The last decode step's attention, every layer, over `fmt`'s copy of the reference cache vs fp32."""
    cache = _copy_cache(ref.cache, spec, fmt)
    seqs = sorted(ref.cache.lengths)
    meta = AttentionMetadata(
        q_lens=(1,) * len(seqs),
        ctx_lens=tuple(ref.cache.lengths[s] for s in seqs),
        block_tables=tuple(tuple(ref.cache.tables[s]) for s in seqs),
        block_size=ref.cache.block_size,
    )
    plan = plan_attention(meta, spec.sliding_window)
    worst = 0.0
    for i, q in enumerate(ref.last_q):
        want = paged_attention(q, ref.cache.k[i], ref.cache.v[i], plan)
        got = paged_attention(q, cache.k[i], cache.v[i], plan)
        worst = max(worst, float((got - want).norm() / want.norm()))
    return worst


def compare(
    name: str, spec: ModelSpec, weights: ModelWeights, prompts: list[list[int]], steps: int, fmts: list[str]
) -> list[Row]:
    ref = generate(spec, weights, prompts, steps, REFERENCE)
    rows = []
    for fmt in fmts:
        free = generate(spec, weights, prompts, steps, fmt)
        forced = generate(spec, weights, prompts, steps, fmt, forced=ref)
        prefix, same, top1 = 0, 0, 0
        for a, b in zip(free.tokens, ref.tokens, strict=True):
            first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
            prefix += first
            same += sum(x == y for x, y in zip(a, b, strict=True))
        err, peak = 0.0, 0.0
        for got, want in zip(forced.logits, ref.logits, strict=True):
            err = max(err, float((got - want).abs().max()))
            peak = max(peak, float(want.abs().max()))
            top1 += int((got.argmax(-1) == want.argmax(-1)).sum())
        total = steps * len(prompts)
        rows.append(
            Row(name, fmt, prefix / total, same / total, err, err / peak, top1 / total, attention_error(spec, ref, fmt))
        )
        print(_line(rows[-1]), flush=True)
    return rows


def _line(r: Row) -> str:
    return (
        f"{r.model:16} {r.format:16} {r.prefix_agreement:8.1%} {r.overall_agreement:8.1%} {r.max_logit_error:10.2e} "
        f"{r.relative_logit_error:9.2e} {r.top1_agreement:7.1%} {r.attention_error:9.2e}"
    )


def exactness_model(name: str, tmp: Path) -> Path:
    """The tests' checkpoints, from their own configs and seeds (max_position_embeddings raised to fit
    the run: Mixtral has no position weights, so the weights are the tests' own)."""
    from test_exactness import CONFIGS

    from reference import E2E_CONFIG, save_hf_mixtral

    if name == "tiny":
        return write_demo_model(tmp / name, "tiny", seed=0, progress=False)
    config, seed = (E2E_CONFIG, 3) if name == "e2e" else (CONFIGS[name], 1)
    return save_hf_mixtral(tmp / name, seed=seed, **{**config, "max_position_embeddings": 1024})


def prompts_for(name: str, model: Path, spec: ModelSpec) -> list[list[int]]:
    if name == "bench":
        tok = TextTokenizer.from_model_dir(model)
        assert tok is not None
        lines = (Path(__file__).parents[1] / "examples" / "demo_prompts.jsonl").read_text().splitlines()
        return [tok.encode(json.loads(x)["prompt"]) for x in lines[:BENCH_PROMPTS]]
    from test_exactness import PROMPTS

    from reference import E2E_PROMPTS

    return [[t % spec.vocab_size for t in p] for p in (E2E_PROMPTS[:5] if name == "e2e" else PROMPTS)]


# ---- speed ----------------------------------------------------------------------------------------------
def _one_layer(spec: ModelSpec) -> ModelSpec:
    return ModelSpec(
        **{**spec.to_dict(), "num_layers": 1, "eos_token_ids": tuple(spec.eos_token_ids), "dense_layers": ()}
    )


@torch.inference_mode()
def decode_ms(spec: ModelSpec, fmts: tuple[str, ...], batch: int, context: int, repeats: int) -> dict[str, float]:
    """Per format, the median ms of one decode step's attention over all layers (one layer timed, times L).
    The formats run interleaved, one call each per round: a neighbour's load on this VM hits all alike."""
    one = _one_layer(spec)
    block = 16
    seqs = list(range(batch))
    kv = torch.randn(batch * -(-context // block) * block, spec.num_kv_heads, spec.head_dim)
    q = torch.randn(batch, spec.num_heads, spec.head_dim)
    runs = {}
    for fmt in fmts:
        cache = PagedKVCache(one, batch * -(-context // block), block, fmt, shuffle_seed=0)
        cache.append(seqs, [context - 1] * batch)
        plan = plan_attention(cache.append(seqs, [1] * batch))
        write_kv(cache.k[0], cache.v[0], kv, -kv, torch.arange(kv.shape[0]))
        runs[fmt] = (cache, plan)
    times: dict[str, list[float]] = {fmt: [] for fmt in fmts}
    for _ in range(repeats + 1):  # the first round warms the buffers up: not counted
        for fmt, (cache, plan) in runs.items():
            t0 = time.perf_counter()
            paged_attention(q, cache.k[0], cache.v[0], plan)
            times[fmt].append(time.perf_counter() - t0)
    return {fmt: statistics.median(t[1:]) * 1e3 * spec.num_layers for fmt, t in times.items()}


@torch.inference_mode()
def fp8_dequant_ms(spec: ModelSpec, batch: int, context: int, repeats: int) -> float:
    """What dequantizing one decode step's fp8 K and V alone costs (all layers): the gathered chunk
    converted to fp32 and scaled, chunk by chunk as the int8 kernel does it (~4 MiB of fp32 a chunk)."""
    tokens = max(16, (4 << 20) // (2 * 4 * spec.num_kv_heads * spec.head_dim))  # K+V in fp32: ~4 MiB
    src = torch.randn(tokens, spec.num_kv_heads, spec.head_dim).to(torch.float8_e4m3fn)
    scales = torch.rand(tokens, spec.num_kv_heads)
    out = torch.empty(tokens, spec.num_kv_heads, spec.head_dim)
    chunks = -(-batch * context // tokens)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for _ in range(2 * chunks):  # K and V
            out.copy_(src).mul_(scales[..., None])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3 * spec.num_layers


def speed(spec: ModelSpec, contexts: list[int], batch: int, repeats: int, fp8: bool) -> list[dict[str, float]]:
    print(
        f"\ndecode attention, ms per step ({spec.num_layers} layers, {batch} sequences, H/K/Hd "
        f"{spec.num_heads}/{spec.num_kv_heads}/{spec.head_dim}, fp32 q, {torch.get_num_threads()} thread(s), "
        f"median of {repeats})"
    )
    out = []
    for c in contexts:
        row: dict[str, float] = {"context": c}
        row.update(decode_ms(spec, (REFERENCE, *REAL), batch, c, repeats))
        if fp8:
            row["fp8_dequant_only"] = fp8_dequant_ms(spec, batch, c, repeats)
        print("  context " + f"{c:6d}: " + "  ".join(f"{k} {v:8.2f}" for k, v in row.items() if k != "context"))
        out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256, help="greedy tokens per prompt")
    ap.add_argument("--models", default=",".join((*EXACTNESS, "bench")))
    ap.add_argument("--bench-model", type=Path, default=Path("models/demo-bench"))
    ap.add_argument("--fp8", action="store_true", help="also the simulated fp8 e4m3 formats")
    ap.add_argument("--contexts", type=int, nargs="*", default=[512, 2048, 4096, 8192])
    ap.add_argument("--speed-batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the speed line's, too)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    fmts = [*REAL, *(FP8 if args.fp8 else ())]
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    print(f"greedy, {args.tokens} tokens per prompt, against the float32 cache (weights fp32)")
    print(
        f"{'model':16} {'format':16} {'prefix':>8} {'overall':>8} {'max |dlogit|':>10} {'/max|lg|':>9} "
        f"{'top-1':>7} {'attn err':>9}"
    )
    rows: list[Row] = []
    bench_spec = None
    with tempfile.TemporaryDirectory(prefix="kv-accuracy-") as tmp:
        for name in filter(None, args.models.split(",")):
            if name == "bench":
                model = args.bench_model
                if not (model / "config.json").exists():
                    sys.stderr.write(f"writing the bench model to {model}...\n")
                    write_demo_model(model, "bench")
            else:
                model = exactness_model(name, Path(tmp))
            spec = ModelSpec.from_pretrained(model)
            weights = load_model_weights(model, spec, progress=False)
            rows += compare(name, spec, weights, prompts_for(name, model, spec), args.tokens, fmts)
            if name == "bench":
                bench_spec = spec
            del weights
    if bench_spec is None:
        bench_spec = ModelSpec.from_pretrained(args.bench_model)
    timings = speed(bench_spec, args.contexts, args.speed_batch, args.repeats, args.fp8) if args.contexts else []
    if args.json is not None:
        args.json.write_text(json.dumps({"accuracy": [asdict(r) for r in rows], "speed": timings}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
