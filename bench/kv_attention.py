"""Decode attention over the paged KV cache: KV bytes read per second, fp32 vs bf16 vs fp16 caches.

One run times, interleaved (this VM is noisy: each round runs every variant once, and we report the
best and the median round):
  (a) the kernel before the KV cache followed the weights' precision (fp32 cache, a per-token slot
      gather of every context, sdpa with GQA expansion), copied below as BASELINE, unchanged;
  (b) the current kernel, fp32 cache and fp32 q;
  (c) bf16 cache, bf16 q (a bf16 model, `--kv-dtype auto`: the softmax weights rounded to bf16 for P @ V);
  (d) fp16 cache, fp16 q (likewise);
  (e) bf16 cache, fp32 q (`--kv-dtype bfloat16` under an fp32 arena: sdpa in fp32 over the upcast chunk);
  (f) and (g): the native decode kernel (moe_lightning/native, docs/kv-cache.md) over the fp32 and the bf16
      cache, fp32 q: what (b) and (e) run where it built (they are timed here with it turned off).
Beside them, this machine's read bandwidth in the same run (a sum over 1 GiB, all threads), and each native
row's share of it (the goal: >= 0.7 at B >= 16 and contexts >= 512); and per shape the native kernels' rate
with their KV in the caches (B = 4, contexts <= 512, called back to back): the kernel's own ceiling on this
CPU, whatever the memory does. Where that ceiling is under 0.7 of the roof, the arithmetic binds, not DRAM.
GB/s counts the K and V bytes of every sequence's real context in the cache's own dtype, so a bf16
cache reads half the bytes of fp32 for the same work: (c) matching (a) in GB/s means attending twice
the tokens per second.

    python bench/kv_attention.py [--repeats 7] [--batches 16 64] [--contexts 128 512 2048] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.native import cpu_isa, decode_kernel
from moe_lightning.spec import ModelSpec
from moe_lightning.stages.attention import AttentionMetadata, paged_attention, plan_attention

SHAPES = {"bench-model 16/4/64": (16, 4, 64), "mixtral-like 32/8/128": (32, 8, 128)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ---- BASELINE: the decode path of moe_lightning/stages/attention.py before the bf16 KV cache ----------
def baseline_plan(meta: AttentionMetadata, sliding_window: int | None = None) -> list[tuple[torch.Tensor, ...]]:
    """Old decode groups: per group (rows (b,), grid (b, Lg) flat cache slot per position, mask (b, 1, 1, Lg))."""
    from moe_lightning.stages.attention import _decode_groups

    out = []
    for rows in _decode_groups(meta.ctx_lens):
        ctx = torch.tensor([meta.ctx_lens[b] for b in rows], dtype=torch.long)
        pos = torch.arange(int(ctx.max()))  # (Lg,)
        width = max(len(meta.block_tables[b]) for b in rows)
        tables = torch.zeros(len(rows), width, dtype=torch.long)
        for i, b in enumerate(rows):
            tables[i, : len(meta.block_tables[b])] = torch.tensor(meta.block_tables[b], dtype=torch.long)
        valid = pos[None, :] < ctx[:, None]  # (b, Lg)
        if sliding_window is not None:
            valid &= (ctx[:, None] - 1 - pos[None, :]) < sliding_window
        block_idx = torch.clamp(pos // meta.block_size, max=width - 1)
        grid = tables[:, block_idx] * meta.block_size + pos % meta.block_size  # (b, Lg)
        grid = torch.where(valid, grid, torch.zeros_like(grid))
        out.append((torch.tensor(rows), grid, valid[:, None, None, :]))
    return out


def baseline_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, groups: list[tuple[torch.Tensor, ...]]
) -> torch.Tensor:
    """Old decode kernel (fp32 cache). q: (B, H, Hd) -> (B, H * Hd)."""
    t, h, hd = q.shape
    kv_heads = k_cache.shape[2]
    k_flat = k_cache.view(-1, kv_heads, hd)  # (NB * BS, K, Hd)
    v_flat = v_cache.view(-1, kv_heads, hd)
    gqa = h != kv_heads
    out = torch.empty(t, h, hd, dtype=q.dtype, device=q.device)
    for rows, grid, mask in groups:
        k = k_flat[grid].transpose(1, 2)  # (b, K, Lg, Hd)
        v = v_flat[grid].transpose(1, 2)  # (b, K, Lg, Hd)
        qg = q[rows][:, :, None, :]  # (b, H, 1, Hd)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, enable_gqa=gqa)  # (b, H, 1, Hd)
        out[rows] = o[:, :, 0, :]
    return out.reshape(t, h * hd)


# ---- END BASELINE ------------------------------------------------------------------------------------


def one_layer_spec(heads: int, kv_heads: int, head_dim: int) -> ModelSpec:
    return ModelSpec(
        architecture="MixtralForCausalLM",
        hidden_size=heads * head_dim,
        intermediate_size=64,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        num_experts=2,
        top_k=1,
        vocab_size=32,
    )


def decode_batch(spec: ModelSpec, batch: int, context: int, block_size: int = 16) -> tuple[PagedKVCache, list[int]]:
    """A one-layer fp32 cache with `batch` sequences of ragged context (context - up to 25 %), blocks shuffled,
    and the decode step's metadata appended."""
    ctx = [context - (i * 37) % max(1, context // 4) for i in range(batch)]
    blocks = sum(-(-c // block_size) for c in ctx) + batch
    cache = PagedKVCache(spec, blocks, block_size, shuffle_seed=0)
    cache.k.normal_(generator=torch.Generator().manual_seed(1))
    cache.v.normal_(generator=torch.Generator().manual_seed(2))
    seqs = list(range(batch))
    cache.append(seqs, [c - 1 for c in ctx])
    return cache, ctx


def run_shape(spec: ModelSpec, batch: int, context: int, repeats: int) -> dict[str, dict[str, float]]:
    cache, ctx = decode_batch(spec, batch, context)
    meta = cache.append(list(range(batch)), [1] * batch)
    q = torch.randn(batch, spec.num_heads, spec.head_dim, generator=torch.Generator().manual_seed(3))
    k32, v32 = cache.k[0], cache.v[0]
    old_groups = baseline_plan(meta)
    plan = plan_attention(meta)
    k16, v16 = {n: k32.to(dt) for n, dt in DTYPES.items()}, {n: v32.to(dt) for n, dt in DTYPES.items()}
    q16 = {n: q.to(dt) for n, dt in DTYPES.items()}
    torch_plan = replace(plan, native=None)
    variants = {
        "(a) baseline fp32": (lambda: baseline_decode(q, k32, v32, old_groups), 4),
        "(b) new fp32": (lambda: paged_attention(q, k32, v32, torch_plan), 4),
        "(c) new bf16": (lambda: paged_attention(q16["bf16"], k16["bf16"], v16["bf16"], torch_plan), 2),
        "(d) new fp16": (lambda: paged_attention(q16["fp16"], k16["fp16"], v16["fp16"], torch_plan), 2),
        "(e) bf16, fp32 q": (lambda: paged_attention(q, k16["bf16"], v16["bf16"], torch_plan), 2),
    }
    if plan.native is not None:
        variants["(f) native fp32"] = (lambda: paged_attention(q, k32, v32, plan), 4)
        variants["(g) native bf16"] = (lambda: paged_attention(q, k16["bf16"], v16["bf16"], plan), 2)
    ref = baseline_decode(q, k32, v32, old_groups)
    for name, (fn, _) in variants.items():  # warm-up, and the kernels agree
        err = (fn().float() - ref).abs().max().item()
        assert err < (1e-5 if name[:3] in ("(a)", "(b)", "(f)") else 5e-2), f"{name}: max error {err}"
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (fn, _) in variants.items():
            t0 = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - t0)
    tokens = sum(ctx)
    out = {}
    for name, (_, itemsize) in variants.items():
        nbytes = 2 * tokens * spec.kv_size * itemsize
        out[name] = {
            "best_gbps": nbytes / min(seconds[name]) / 1e9,
            "median_gbps": nbytes / statistics.median(seconds[name]) / 1e9,
        }
    base = out["(a) baseline fp32"]
    for r in out.values():
        r["ratio_best"] = r["best_gbps"] / base["best_gbps"]
        r["ratio_median"] = r["median_gbps"] / base["median_gbps"]
    return out


def in_cache_rates(spec: ModelSpec, repeats: int) -> dict[str, float]:
    """GB/s of the native kernels over a batch whose KV stays in the caches (B = 4, contexts <= 512: 1.9 MB
    of bf16 at the `bench` shape, 7.5 at Mixtral's), called back to back: what the kernel computes per
    second with no memory traffic in the way (contexts of the goal's length: a short one's fixed cost per
    sequence would count against the kernel)."""
    cache, ctx = decode_batch(spec, 4, 512)
    plan = plan_attention(cache.append(list(range(4)), [1] * 4))
    q = torch.randn(4, spec.num_heads, spec.head_dim, generator=torch.Generator().manual_seed(3))
    k32, v32 = cache.k[0], cache.v[0]
    k16, v16 = k32.to(torch.bfloat16), v32.to(torch.bfloat16)
    rates = {}
    for name, k, v in (("(f) native fp32", k32, v32), ("(g) native bf16", k16, v16)):
        paged_attention(q, k, v, plan)
        best = float("inf")
        for _ in range(max(20, 4 * repeats)):
            t0 = time.perf_counter()
            paged_attention(q, k, v, plan)
            best = min(best, time.perf_counter() - t0)
        rates[name] = 2 * sum(ctx) * spec.kv_size * k.element_size() / best / 1e9
    return rates


def read_roof(repeats: int) -> float:
    """GB/s of a plain read (a sum over 1 GiB of fp32, all threads): the roof decode attention works under."""
    data = torch.ones(1 << 28)
    data.sum()  # pages faulted in
    best = float("inf")
    for _ in range(max(3, repeats)):
        t0 = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t0)
    return data.numel() * 4 / best / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7, help="interleaved rounds per point")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads. GB/s of KV read: best / median of "
        f"{args.repeats} interleaved rounds, and the median's ratio to (a)"
    )
    names = ["(a) baseline fp32", "(b) new fp32", "(c) new bf16", "(d) new fp16", "(e) bf16, fp32 q"]
    kernel = decode_kernel()
    names += ["(f) native fp32", "(g) native bf16"] if kernel is not None else []
    roof = read_roof(args.repeats)
    built = f"built, {cpu_isa()}" if kernel is not None else "not built"
    print(f"native decode kernel: {built}; read roof {roof:.1f} GB/s")
    print(f"{'shape':22s} {'B':>3s} {'ctx<=':>5s}  " + "  ".join(f"{n:>21s}" for n in names))
    results = []
    ceilings: dict[str, dict[str, float]] = {}
    for shape in args.shapes:
        spec = one_layer_spec(*SHAPES[shape])
        if kernel is not None:
            ceilings[shape] = in_cache_rates(spec, args.repeats)
        for batch in args.batches:
            for context in args.contexts:
                r = run_shape(spec, batch, context, args.repeats)
                results.append({"shape": shape, "batch": batch, "context": context, "variants": r})
                cells = "  ".join(
                    f"{r[n]['best_gbps']:6.2f} /{r[n]['median_gbps']:6.2f} x{r[n]['ratio_median']:4.2f}" for n in names
                )
                print(f"{shape:22s} {batch:3d} {context:5d}  {cells}", flush=True)
    for n in names[2:]:
        worst = min(r["variants"][n]["ratio_median"] for r in results)
        print(f"{n}: worst median ratio to (a) in KV bytes per second {worst:.2f} (goal >= 1)")
    for n in names[5:]:
        goal = [r for r in results if r["batch"] >= 16 and r["context"] >= 512]
        if goal:
            worst = min(r["variants"][n]["best_gbps"] / roof for r in goal)
            print(f"{n}: worst share of the read roof at B >= 16, contexts >= 512: {worst:.2f} (goal >= 0.7)")
        for shape, rates in ceilings.items():
            print(
                f"{n}, {shape}, KV in the caches (B = 4, ctx <= 512, back to back): {rates[n]:.1f} GB/s, "
                f"{rates[n] / roof:.2f} of the read roof: the kernel's ceiling on this CPU"
            )
    if args.json is not None:
        report = {
            "read_roof_gbps": roof,
            "isa": cpu_isa(),
            "native": kernel is not None,
            "in_cache_gbps": ceilings,
            "cases": results,
        }
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
