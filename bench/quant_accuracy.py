"""What quantized experts cost in accuracy on the `bench` model: perplexity of a fixed text, the
logit error at each position and top-1 agreement, for fp32 / int8 / int4, teacher forced
(moe_lightning/quant/accuracy.py; tests/test_quant_accuracy.py bounds the same numbers).

    python bench/quant_accuracy.py [--model models/demo-bench] [--group-size 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from moe_lightning.demo_model import write_demo_model
from moe_lightning.quant.accuracy import fixed_text, measure
from moe_lightning.quant.scheme import QuantFormat, QuantScheme
from moe_lightning.tokenizer import TextTokenizer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("models/demo-bench"))
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not (args.model / "config.json").exists():
        sys.stderr.write(f"writing the bench model to {args.model}...\n")
        write_demo_model(args.model, "bench")
    tok = TextTokenizer.from_model_dir(args.model)
    if tok is None:
        raise SystemExit(f"{args.model} has no tokenizer.json")
    tokens = tok.encode(fixed_text())
    schemes = [QuantScheme(QuantFormat.INT8), QuantScheme(QuantFormat.INT4, args.group_size)]
    rows = measure(args.model, schemes, tokens)
    print(f"{len(tokens)} tokens of the fixed text, teacher forced")
    print(f"{'format':10} {'perplexity':>11} {'max logit err':>14} {'mean logit err':>15} {'top-1 agree':>12}")
    for r in rows:
        print(
            f"{r.format:10} {r.perplexity:11.2f} {r.max_logit_error:14.4f} {r.mean_logit_error:15.4f} "
            f"{r.top1_agreement:12.1%}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
