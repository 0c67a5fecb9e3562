"""The `moe-lightning` command line. Every flag can also be set by environment variable:
`--max-new-tokens` is MOE_LIGHTNING_MAX_NEW_TOKENS, and so on."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ENV_PREFIX = "MOE_LIGHTNING_"


class EnvDefaultsParser(argparse.ArgumentParser):
    """An ArgumentParser whose options take their default from MOE_LIGHTNING_<FLAG> when set."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:  # type: ignore[override]
        action = super().add_argument(*args, **kwargs)
        if action.option_strings and action.dest != "help":
            env = ENV_PREFIX + action.dest.upper()
            if env in os.environ:
                raw = os.environ[env]
                if isinstance(action, argparse._StoreTrueAction):
                    action.default = raw.lower() in ("1", "true", "yes", "on")
                elif isinstance(action, argparse._AppendAction):
                    action.default = [action.type(v) if action.type else v for v in raw.split(",")]
                else:
                    action.default = action.type(raw) if action.type else raw
                action.required = False
            if action.help and action.help is not argparse.SUPPRESS:
                action.help += f" [env {env}]"
        return action


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling stream (reproducible)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def build_parser() -> argparse.ArgumentParser:
    parser = EnvDefaultsParser(prog="moe-lightning", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=EnvDefaultsParser)

    demo = sub.add_parser("make-demo-model", help="write a built-in HF-format Mixtral checkpoint")
    demo.add_argument("--preset", default="tiny", help="tiny (a few MB) or bench (~0.8 B params, 3.2 GB fp32)")
    demo.add_argument("--out", required=True, type=Path, help="output directory")
    demo.add_argument("--seed", type=int, default=0, help="weights and tokenizer are deterministic by seed")
    demo.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])

    gen = sub.add_parser("generate", help="generate text in-process")
    gen.add_argument("--model", required=True, type=Path, help="HF checkpoint directory")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    src.add_argument("--prompt-ids", action="append", type=_ids, help="comma-separated token ids (repeatable)")
    src.add_argument("--prompts-file", type=Path, help="a text file, one prompt per line")
    _add_sampling_flags(gen)
    gen.add_argument("--device", default="cpu", help="cpu or cuda")
    gen.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="compute dtype; auto = float32 on cpu, the checkpoint's on cuda",
    )
    gen.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens")
    gen.add_argument("--no-progress", action="store_true", help="no progress bar while loading")
    return parser


def _compute_dtype(name: str, checkpoint_dtype: str, device: str) -> Any:
    import torch

    from moe_lightning.spec import DTYPES

    if name == "auto":
        return torch.float32 if device == "cpu" else DTYPES[checkpoint_dtype]
    return DTYPES[name]


def cmd_make_demo_model(args: argparse.Namespace) -> int:
    from moe_lightning.demo_model import write_demo_model

    t0 = time.perf_counter()
    out = write_demo_model(args.out, args.preset, seed=args.seed, dtype=args.dtype)
    sys.stderr.write(f"wrote {args.preset} demo model to {out} in {time.perf_counter() - t0:.1f} s\n")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from moe_lightning.checkpoint import load_model_weights
    from moe_lightning.engine import InProcessEngine
    from moe_lightning.request import GenerationRequest
    from moe_lightning.sampling import SamplingParams
    from moe_lightning.spec import ModelSpec
    from moe_lightning.tokenizer import TextTokenizer

    spec = ModelSpec.from_pretrained(args.model)
    tokenizer = TextTokenizer.from_model_dir(args.model)
    texts = args.prompt
    if args.prompts_file is not None:
        texts = [line for line in args.prompts_file.read_text().splitlines() if line.strip()]
    if texts is not None:
        if tokenizer is None:
            raise SystemExit(f"error: {args.model} has no tokenizer.json; pass --prompt-ids instead of --prompt")
        prompts = [tokenizer.encode(p) for p in texts]
    else:
        prompts = args.prompt_ids
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    requests = [GenerationRequest(p, args.max_new_tokens, sampling, tuple(args.stop), args.ignore_eos) for p in prompts]
    for r in requests:
        r.validate(spec)
    t0 = time.perf_counter()
    dtype = _compute_dtype(args.dtype, spec.dtype, args.device)
    weights = load_model_weights(args.model, spec, dtype, args.device, progress=not args.no_progress)
    load_s = time.perf_counter() - t0
    engine = InProcessEngine(spec, weights, tokenizer, args.block_size, args.device)
    results, stats = engine.generate(requests)
    timings = {"load_seconds": load_s, **stats.to_dict()}
    for r in results:
        if args.json:
            obj = {
                "token_ids": r.token_ids,
                "text": r.text,
                "finish_reason": r.finish_reason,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "timings": timings,
            }
            sys.stdout.write(json.dumps(obj) + "\n")
        else:
            sys.stdout.write((r.text if r.text is not None else " ".join(map(str, r.token_ids))) + "\n")
    if not args.json:
        sys.stderr.write(
            f"{stats.generated_tokens} tokens for {len(results)} prompts in {stats.total_seconds:.2f} s: "
            f"{timings['generated_tokens_per_second']:.1f} tok/s overall, "
            f"{timings['decode_tokens_per_second']:.1f} tok/s decode (load {load_s:.1f} s)\n"
        )
    return 0


COMMANDS = {"make-demo-model": cmd_make_demo_model, "generate": cmd_generate}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from moe_lightning.checkpoint import CheckpointError
    from moe_lightning.request import InvalidRequestError
    from moe_lightning.spec import ModelSpecError

    try:
        return COMMANDS[args.command](args)
    except (ModelSpecError, CheckpointError, InvalidRequestError, ValueError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
