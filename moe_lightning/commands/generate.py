"""generate: in-process (--model) or against a running stack (--addr)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from moe_lightning.commands.common import add_client_flags, add_sampling_flags, add_where_flags, token_ids
from moe_lightning.config import flags


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help="generate text, in-process (--model) or from a running stack (--addr)")
    add_where_flags(p)  # --model: every stage in this process; --addr: a running stack
    add_client_flags(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    src.add_argument("--prompt-ids", action="append", type=token_ids, help="comma-separated token ids (repeatable)")
    src.add_argument("--prompts-file", type=Path, help="a text file, one prompt per line")
    add_sampling_flags(p)
    flags.JSON.add_to(p, default=False)  # one JSON object per prompt
    p.add_argument("--stream", action="store_true", help="print the text as it is generated (--addr, one prompt)")
    flags.DEVICE.add_to(p, default="cpu")  # in-process only
    flags.DTYPE.add_to(p, default="auto")
    flags.BLOCK_SIZE.add_to(p, default=16)
    flags.NO_PROGRESS.add_to(p, default=False)


def _texts(args: argparse.Namespace) -> list[str] | None:
    if args.prompts_file is not None:
        return [line for line in args.prompts_file.read_text().splitlines() if line.strip()]
    return args.prompt


def _print(results: list[dict[str, Any]], timings: dict[str, float], as_json: bool) -> None:
    for r in results:
        if as_json:
            sys.stdout.write(json.dumps({**r, "timings": {**timings, **r.get("timings", {})}}) + "\n")
        else:
            sys.stdout.write((r["text"] if r["text"] is not None else " ".join(map(str, r["token_ids"]))) + "\n")


def run(args: argparse.Namespace) -> int:
    return _remote(args) if args.addr else _local(args)


def _local(args: argparse.Namespace) -> int:
    # the prompts and the flags are checked before torch is imported: a mistake is told in a fraction
    # of a second, not after the seconds its import takes
    from moe_lightning.request import GenerationRequest
    from moe_lightning.sampling import SamplingParams
    from moe_lightning.spec import ModelSpec
    from moe_lightning.tokenizer import TextTokenizer
    from moe_lightning.validation import RequestLimits, validate

    spec = ModelSpec.from_pretrained(args.model)
    tokenizer = TextTokenizer.from_model_dir(args.model)
    texts = _texts(args)
    if texts is not None:
        if tokenizer is None:
            raise ValueError(f"{args.model} has no tokenizer.json; pass --prompt-ids instead of --prompt")
        prompts = [tokenizer.encode(t) for t in texts]
    else:
        prompts = args.prompt_ids
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    requests = [GenerationRequest(p, args.max_new_tokens, sampling, tuple(args.stop), args.ignore_eos) for p in prompts]
    limits = RequestLimits.of(spec)  # the model's own: no server stands between
    for r in requests:
        validate(r, limits)

    from moe_lightning.checkpoint import load_model_weights
    from moe_lightning.engine import InProcessEngine
    from moe_lightning.spec import resolve_dtype
    from moe_lightning.torch_dtypes import DTYPES

    dtype = DTYPES[resolve_dtype(args.dtype, spec.dtype, args.device)]  # auto: as `up` resolves it
    t0 = time.perf_counter()
    weights = load_model_weights(args.model, spec, dtype, args.device, progress=not args.no_progress)
    load_s = time.perf_counter() - t0
    results, stats = InProcessEngine(spec, weights, tokenizer, args.block_size, args.device).generate(requests)
    timings = {"load_seconds": load_s, **stats.to_dict()}
    rows = [
        {
            "token_ids": r.token_ids,
            "text": r.text,
            "finish_reason": r.finish_reason,
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens,
        }
        for r in results
    ]
    _print(rows, timings, args.json)
    if not args.json:
        sys.stderr.write(
            f"{stats.generated_tokens} tokens for {len(results)} prompts in {stats.total_seconds:.2f} s: "
            f"{timings['generated_tokens_per_second']:.1f} tok/s overall, "
            f"{timings['decode_tokens_per_second']:.1f} tok/s decode (load {load_s:.1f} s)\n"
        )
    return 0


def _stream(client: Any, prompts: list[Any], as_json: bool) -> int:
    """One prompt's text (or, without a tokenizer, token ids) as it comes; --json: one object per piece."""
    from moe_lightning.client import Completion

    if len(prompts) != 1:
        raise ValueError(f"--stream takes one prompt, got {len(prompts)}")
    wrote_text = False
    for piece in client.stream(prompts[0]):
        if isinstance(piece, Completion):
            if as_json:
                sys.stdout.write(json.dumps({"done": True, **piece.to_dict()}) + "\n")
            else:
                if not wrote_text:  # a model without a tokenizer: its ids, once at the end
                    sys.stdout.write(" ".join(map(str, piece.token_ids)))
                sys.stdout.write("\n")
                sys.stderr.write(f"[{piece.finish_reason}, {piece.completion_tokens} tokens]\n")
        elif as_json:
            sys.stdout.write(json.dumps({"token_ids": piece.token_ids, "text": piece.text}) + "\n")
        else:
            sys.stdout.write(piece.text)
            wrote_text = wrote_text or bool(piece.text)
        sys.stdout.flush()
    return 0


def _remote(args: argparse.Namespace) -> int:
    from moe_lightning.client import GenerationClient, Prompt

    texts = _texts(args)
    common = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=list(args.stop),
        ignore_eos=args.ignore_eos,
    )
    if texts is not None:
        prompts = [Prompt(text=t, **common) for t in texts]  # type: ignore[arg-type]
    else:
        prompts = [Prompt(token_ids=ids, **common) for ids in args.prompt_ids]  # type: ignore[arg-type]
    t0 = time.perf_counter()
    with GenerationClient(
        args.addr, tls_ca=args.tls_ca, token=args.auth_token, allow_insecure_token=args.allow_insecure_token
    ) as client:
        if args.stream:
            return _stream(client, prompts, args.json)
        done = client.batch_generate(prompts) if len(prompts) > 1 else [client.generate(prompts[0])]
    wall = time.perf_counter() - t0
    generated = sum(c.completion_tokens for c in done)
    timings = {
        "wall_seconds": wall,
        "generated_tokens": generated,
        "generated_tokens_per_second": generated / wall if wall else 0.0,
    }
    rows = [
        {
            "token_ids": c.token_ids,
            "text": c.text,
            "finish_reason": c.finish_reason,
            "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.completion_tokens,
            "timings": {
                "queue_seconds": c.queue_seconds,
                "time_to_first_token_seconds": c.time_to_first_token_seconds,
                "total_seconds": c.total_seconds,
            },
        }
        for c in done
    ]
    _print(rows, timings, args.json)
    if not args.json:
        sys.stderr.write(
            f"{generated} tokens for {len(done)} prompts in {wall:.2f} s: "
            f"{timings['generated_tokens_per_second']:.1f} tok/s\n"
        )
    return 0
