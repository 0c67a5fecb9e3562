"""Every quantized kernel against the dense GEMM, per weight shape and row count, on this machine:
the table in docs/quantization.md ("Kernels"). What gpu_expert does at warm-up, for all rows at once.

    python bench/quant_kernels.py [--shape 7168x1024] [--rows 1 8 64 256] [--group-size 128] [--device cpu]
                                  [--formats int8 int4 mxfp4]

--group-size is int4's; mxfp4's blocks are 32 (K must be a multiple of 32). The last line is the
time of dequantizing the whole weight alone, in the activations' dtype, per format.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from moe_lightning.quant import kernels
from moe_lightning.quant.kernels import dense_linear
from moe_lightning.quant.rtn import quantize
from moe_lightning.quant.scheme import QuantFormat, QuantScheme


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="7168x1024", help="N x K of the weight (the bench model's w13)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--formats", nargs="+", default=["int8", "int4", "mxfp4"], choices=["int8", "int4", "mxfp4"])
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    w = torch.randn(n, k, device=device) * 0.02
    formats = [QuantFormat(f) for f in args.formats]
    if QuantFormat.MXFP4 in formats and k % 32:
        print(f"mxfp4 left out: K={k} is not a multiple of its block of 32")
        formats.remove(QuantFormat.MXFP4)
    pages = {fmt: quantize(w, QuantScheme(fmt, args.group_size)) for fmt in formats}
    dense = w.to(dtype)
    results: dict[str, dict[str, float]] = {}
    for rows in args.rows:
        x = torch.randn(rows, k, device=device, dtype=dtype)
        row = {"dense": kernels._time(lambda x, _: dense_linear(x, dense), x, None)}  # type: ignore[arg-type]
        for kernel in kernels.KERNELS:
            if kernel.format not in pages or not kernel.usable(device) or not kernel.races(dtype):
                continue
            try:
                row[f"{kernel.format}:{kernel.name}"] = kernels._time(kernel.fn, x, pages[kernel.format])
            except (RuntimeError, NotImplementedError) as exc:
                print(f"{kernel.format}:{kernel.name} unavailable: {str(exc).splitlines()[0]}")
        results[str(rows)] = row
    names = list(next(iter(results.values())))
    print(f"{n}x{k}, {args.dtype} activations on {device}, ms per call (best of 3 after one warm call)")
    print("rows " + " ".join(f"{name:>28}" for name in names))
    for rows, row in results.items():
        print(f"{rows:>4} " + " ".join(f"{row.get(name, float('nan')) * 1e3:28.2f}" for name in names))
    dequant = {str(fmt): kernels._time(lambda _, ql: ql.dequantize(dtype), x, ql) * 1e3 for fmt, ql in pages.items()}
    print("dequantize alone, ms: " + ", ".join(f"{fmt} {ms:.2f}" for fmt, ms in dequant.items()))
    if args.json is not None:
        seconds = {f: ms / 1e3 for f, ms in dequant.items()}
        args.json.write_text(json.dumps({**results, "dequantize": seconds}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
