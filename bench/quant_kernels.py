"""Every quantized kernel against the dense GEMM, per weight shape and row count, on this machine:
the table in docs/quantization.md ("Kernels"). What gpu_expert does at warm-up, for all rows at once.

    python bench/quant_kernels.py [--shape 7168x1024] [--rows 1 8 64 256] [--group-size 128] [--device cpu]
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
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    w = torch.randn(n, k, device=device) * 0.02
    pages = {fmt: quantize(w, QuantScheme(fmt, args.group_size)) for fmt in (QuantFormat.INT8, QuantFormat.INT4)}
    dense = w.to(dtype)
    results: dict[str, dict[str, float]] = {}
    for rows in args.rows:
        x = torch.randn(rows, k, device=device, dtype=dtype)
        row = {"dense": kernels._time(lambda x, _: dense_linear(x, dense), x, pages[QuantFormat.INT8])}
        for kernel in kernels.KERNELS:
            if not kernel.usable(device):
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
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
