"""llama.cpp through llama-cpp-python's low-level bindings, in a process of its own per run (its
threads, memory and mapped file go when it ends, as our stack's processes do):

    python -m bench.vsllama.llama_worker generate GGUF PROMPTS_JSON OUT_JSON [--gen-len 32] [--threads 2]
        [--kv-unified] [--no-extra-bufts]
    python -m bench.vsllama.llama_worker quantize F32_GGUF OUT_GGUF q8_0|q4_0 [--threads 2]

`generate` runs llama.cpp batched, as its own batched tools do, not one sequence at a time: one context
holds every sequence (n_seq_max = N), prompts are prefilled whole, packed into llama_decode calls of up
to PREFILL_BATCH tokens with logits for each prompt's last token only; then every decode step is ONE
llama_decode of N tokens, one per sequence (n_ubatch >= N, so one graph a step), and the next tokens
are the argmax of the N rows of logits it returns (greedy, EOS ignored). Each sequence has a KV stream
of its own (kv_unified off), the faster layout for decode here: fp32, 64 MT-Bench prompts, 157 tok/s
against 118 with one buffer for all sequences (--kv-unified), and 165 against 90 at 256 prompts, where
a step attends over every sequence's cells under a mask; prefill is 5-10 % faster unified. Everything
else is llama.cpp's default (f16 KV cache, flash attention by its own choice, mmap, and its extra
weight buffer types: q8_0 / q4_0 weights repacked for this CPU's kernels, AMX tiles where the CPU has
AMX; --no-extra-bufts keeps the weights as the file has them, for CPUs where those crash).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path
from typing import Any

PREFILL_BATCH = 2048  # prompt tokens a prefill llama_decode takes (whole prompts); llama.cpp splits it in ubatches
DEFAULT_UBATCH = 512  # llama.cpp's default n_ubatch
FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}
WARN = 3  # ggml_log_level: GGML_LOG_LEVEL_WARN; below it is llama.cpp's chatter about the model


def _quiet_logs(llama: Any) -> Any:
    """Warnings and errors to stderr, the rest dropped. Returns the callback: it must stay referenced."""

    @llama.llama_log_callback
    def callback(level: int, text: bytes, _user: Any) -> None:
        if level >= WARN and level != 5:  # 5: a continuation of the previous line
            sys.stderr.write(text.decode(errors="replace"))

    llama.llama_log_set(callback, ctypes.c_void_p(0))
    return callback


def pack_prompts(lengths: list[int], limit: int) -> list[list[int]]:
    """Indices of prompts, in order, grouped so that each group's tokens fit in `limit` (a prompt is
    never split: each must fit alone)."""
    groups: list[list[int]] = []
    used = limit
    for i, n in enumerate(lengths):
        if n > limit:
            raise ValueError(f"prompt {i} has {n} tokens, more than a prefill batch ({limit})")
        if used + n > limit:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


class Batch:
    """A llama_batch filled token by token: (token, position, sequence, wants logits)."""

    def __init__(self, llama: Any, capacity: int) -> None:
        self.llama = llama
        self.raw = llama.llama_batch_init(capacity, 0, 1)
        self.capacity = capacity

    def fill(self, rows: list[tuple[int, int, int, bool]]) -> None:
        if len(rows) > self.capacity:
            raise ValueError(f"{len(rows)} tokens in a batch of {self.capacity}")
        b = self.raw
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)

    def free(self) -> None:
        self.llama.llama_batch_free(self.raw)


def generate(
    gguf: Path,
    prompts: list[list[int]],
    gen_len: int,
    threads: int,
    kv_unified: bool = False,
    extra_bufts: bool = True,
) -> dict[str, Any]:
    """Greedy generation of `gen_len` tokens for every prompt, all sequences in one batch; the
    prefill and decode phases timed apart (each including the argmax over the logits)."""
    import llama_cpp as llama
    import numpy as np

    keep = _quiet_logs(llama)
    llama.llama_backend_init()
    n = len(prompts)
    t0 = time.perf_counter()
    mp = llama.llama_model_default_params()
    mp.use_extra_bufts = extra_bufts
    model = llama.llama_model_load_from_file(str(gguf).encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model))
    cp = llama.llama_context_default_params()
    longest = max(map(len, prompts)) + gen_len
    # a stream of its own per sequence takes n_ctx / n_seq_max cells, which llama.cpp rounds up to 256
    cp.n_ctx = sum(len(p) + gen_len for p in prompts) if kv_unified else -(-longest // 256) * 256 * n
    cp.n_seq_max, cp.kv_unified = n, kv_unified
    cp.n_batch, cp.n_ubatch = max(PREFILL_BATCH, n), max(DEFAULT_UBATCH, n)
    cp.n_threads = cp.n_threads_batch = threads
    ctx = llama.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError(f"llama.cpp could not make a context of {cp.n_ctx} cells for {n} sequences")
    batch = Batch(llama, cp.n_batch)
    load = time.perf_counter() - t0

    def run(rows: list[tuple[int, int, int, bool]]) -> np.ndarray:
        batch.fill(rows)
        rc = llama.llama_decode(ctx, batch.raw)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a batch of {len(rows)} tokens")
        outputs = sum(1 for r in rows if r[3])
        logits = np.ctypeslib.as_array(llama.llama_get_logits(ctx), shape=(outputs, vocab))
        return logits.argmax(axis=1)

    # warm-up (ours gets one too): a decode-shaped batch, then an empty cache
    run([(p[0], 0, s, True) for s, p in enumerate(prompts)])
    llama.llama_memory_clear(llama.llama_get_memory(ctx), True)

    out = [[] for _ in prompts]
    t0 = time.perf_counter()
    for group in pack_prompts([len(p) for p in prompts], cp.n_batch):
        rows = [(t, j, s, j == len(prompts[s]) - 1) for s in group for j, t in enumerate(prompts[s])]
        for s, token in zip(group, run(rows).tolist(), strict=True):
            out[s].append(token)
    prefill = time.perf_counter() - t0

    from tqdm import tqdm

    bar = tqdm(total=gen_len - 1, desc=f"llama.cpp decode, {n} sequences", unit="step", file=sys.stderr)
    in_llama = 0.0
    t0 = time.perf_counter()
    for step in range(gen_len - 1):
        rows = [(out[s][-1], len(p) + step, s, True) for s, p in enumerate(prompts)]
        t1 = time.perf_counter()
        tokens = run(rows).tolist()
        in_llama += time.perf_counter() - t1
        for s, token in enumerate(tokens):
            out[s].append(token)
        bar.update()
    decode = time.perf_counter() - t0
    bar.close()
    batch.free()
    llama.llama_free(ctx)
    llama.llama_model_free(model)
    del keep
    return {
        "load_seconds": load,
        "prefill_seconds": prefill,
        "decode_seconds": decode,
        "decode_call_seconds": in_llama,  # inside llama_decode and the argmax: the rest is this loop's Python
        "n_ctx": cp.n_ctx,
        "n_batch": cp.n_batch,
        "n_ubatch": cp.n_ubatch,
        "kv_unified": kv_unified,
        "extra_bufts": extra_bufts,
        "threads": threads,
        "token_ids": out,
    }


def quantize(source: Path, target: Path, kind: str, threads: int) -> None:
    """llama.cpp's own quantization (what its llama-quantize tool calls) of an f32 GGUF."""
    import llama_cpp as llama

    keep = _quiet_logs(llama)
    params = llama.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = getattr(llama, FTYPES[kind])
    rc = llama.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    del keep
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({source} -> {kind}) returned {rc}")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.vsllama.llama_worker")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("gguf", type=Path)
    g.add_argument("prompts", type=Path, help="a JSON list of token-id lists")
    g.add_argument("out", type=Path)
    g.add_argument("--gen-len", type=int, default=32)
    g.add_argument("--threads", type=int, default=2)
    g.add_argument("--kv-unified", action="store_true", help="one KV buffer for all sequences, not a stream each")
    g.add_argument(
        "--no-extra-bufts",
        action="store_true",
        help="weights as the file has them: no repacking for this CPU's kernels, no AMX buffers",
    )
    q = sub.add_parser("quantize")
    q.add_argument("source", type=Path)
    q.add_argument("target", type=Path)
    q.add_argument("kind", choices=sorted(FTYPES))
    q.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.cmd == "quantize":
        quantize(args.source, args.target, args.kind, args.threads)
        return
    prompts = json.loads(args.prompts.read_text())
    result = generate(
        args.gguf, prompts, args.gen_len, args.threads, kv_unified=args.kv_unified, extra_bufts=not args.no_extra_bufts
    )
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
