"""Every GEMM kernel the chooser races (moe_lightning/quant/kernels.py KERNELS: the dense ones and each
format's), per weight shape and row count, on this machine: the tables in docs/quantization.md
("Kernels"). What gpu_expert's warm-up does, for all rows at once.

    python bench/quant_kernels.py [--shape 7168x1024] [--rows 8 16 32 64] [--group-size 128] [--device cpu]
                                  [--formats none int8 int4 mxfp4] [--experts 8] [--rounds 5] [--json OUT]

Each call multiplies by the next of --experts distinct weights of the shape (random, quantized as
`--quantize` does), as a layer's experts follow one another in a step: with 8 (the default) a
(7168, 1024) fp32 weight set is 235 MB, far past the caches, so the times include reading the weight
from memory, which is what decode's GEMMs wait on; --experts 1 keeps one weight in the caches (the
kernels' compute alone). The kernels take turns within each of --rounds rounds and each keeps its best
time per call, so a burst of load from other processes falls on all of them alike. --group-size is
int4's; mxfp4's blocks are 32 (K must be a multiple of 32). The last line is the time of dequantizing
one weight alone, per format.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from moe_lightning.quant import kernel_choice, kernels
from moe_lightning.quant.kernel_choice import Kernel
from moe_lightning.quant.kernels import Weight
from moe_lightning.quant.rtn import quantize
from moe_lightning.quant.scheme import QuantFormat, QuantScheme


def pages_of(fmt: QuantFormat, weights: list[torch.Tensor], dtype: torch.dtype, group_size: int) -> list[Weight]:
    if fmt is QuantFormat.NONE:
        return [w.to(dtype) for w in weights]
    return [quantize(w, QuantScheme(fmt, group_size)) for w in weights]


def race(found: list[tuple[str, Kernel]], pages: dict[QuantFormat, list[Weight]], x: torch.Tensor, rounds: int) -> dict:
    """{column: best seconds per call}, each kernel once through every page per round. Round 0 is not
    counted (first calls), except for a kernel that took 8x its format's best there: as in the
    chooser's race (`_far_behind`, quant/kernel_choice.py), it keeps that time and runs no more
    (int4mm_cpu: ~0.5 s a call)."""
    first: dict[str, float] = {}
    best: dict[str, float] = {}
    for r in range(rounds + 1):
        for column, kernel in list(found):
            if r and column not in best and column in first:
                continue  # far behind: its first time stands
            ws = pages[kernel.format]
            try:
                kernel_choice.sync(x.device)
                t0 = time.perf_counter()
                for w in ws:
                    kernel.fn(x, w)
                kernel_choice.sync(x.device)
            except (RuntimeError, NotImplementedError) as exc:  # a shape this kernel does not take
                print(f"{column} unavailable: {str(exc).splitlines()[0]}")
                found.remove((column, kernel))
                continue
            seconds = (time.perf_counter() - t0) / len(ws)
            if r:
                best[column] = min(best[column], seconds)
            else:
                first[column] = seconds
        if not r:
            for column, kernel in found:
                fastest = min(t for c, t in first.items() if c.split(":")[0] == str(kernel.format))
                if first[column] <= kernel_choice.PRUNE_BEHIND * fastest:
                    best[column] = math.inf  # raced
    return {column: best[column] if column in best else first[column] for column in first}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="7168x1024", help="N x K of the weight (the bench model's w13)")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--experts", type=int, default=8, help="distinct weights a call cycles through (1: cached)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--formats", nargs="+", default=["none", "int8", "int4", "mxfp4"], choices=["none", "int8", "int4", "mxfp4"]
    )
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=g) * 0.02).to(device) for _ in range(args.experts)]
    formats = [QuantFormat(f) for f in args.formats]
    if QuantFormat.MXFP4 in formats and k % 32:
        print(f"mxfp4 left out: K={k} is not a multiple of its block of 32")
        formats.remove(QuantFormat.MXFP4)
    pages = {fmt: pages_of(fmt, weights, dtype, args.group_size) for fmt in formats}
    found = [
        (f"{k.format}:{k.name}", k)
        for k in kernels.KERNELS
        if k.format in pages and k.usable(device) and k.races(dtype)
    ]
    results: dict[str, dict[str, float]] = {}
    for rows in args.rows:
        x = torch.randn(rows, k, generator=g).to(device=device, dtype=dtype)
        results[str(rows)] = race(found, pages, x, args.rounds)
    names = [column for column, _ in found]
    print(
        f"{n}x{k}, {args.dtype} activations on {device}, {args.experts} distinct weights, ms per call "
        f"(best of {args.rounds} interleaved rounds)"
    )
    width = max(len(name) for name in names) + 1
    print("rows " + " ".join(f"{name:>{width}}" for name in names))
    for rows, row in results.items():
        print(f"{rows:>4} " + " ".join(f"{row.get(name, math.nan) * 1e3:{width}.3f}" for name in names))
    x = torch.randn(1, k, device=device)
    dequant = {
        str(fmt): kernel_choice.best_time(lambda _, ql: ql.dequantize(dtype), x, ws[0]) * 1e3
        for fmt, ws in pages.items()
        if fmt is not QuantFormat.NONE
    }
    if dequant:
        print("dequantize alone, ms: " + ", ".join(f"{fmt} {ms:.2f}" for fmt, ms in dequant.items()))
    if args.json is not None:
        seconds = {f: ms / 1e3 for f, ms in dequant.items()}
        args.json.write_text(json.dumps({**results, "dequantize": seconds}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
