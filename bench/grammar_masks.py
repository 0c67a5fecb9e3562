"""Grammar token masks: per-step cost and compile time of llguidance, xgrammar and outlines-core.

Per step, for B sequences each with its own matcher: fill the next-token bitmask of all B (the
library's batched / parallel fill: llguidance's LLExecutor, xgrammar's BatchGrammarMatcher; outlines-core
has none, so a loop of `write_mask_into`), apply it to a (B, V) fp32 logits tensor in one call (the same
torch kernel for all three, moe_lightning.grammar.apply_token_bitmask; xgrammar's own CPU kernel is timed
next to it), and accept one token per sequence (batched where the library has it). Tokens are the
argmax of the masked logits, each row's logits one of 64 fixed random rows drawn anew every step, so
the B sequences spread over the grammar's states; a sequence that ends (stop token) or reaches 256
tokens starts over (untimed). Warm-up steps first, then the median of the timed steps.

Grammars: any JSON object; a JSON schema (nested object, enum, bounded integer, string maxLength, array
with maxItems); an e-mail-like regex; a 4-way choice. Vocabularies: byte-level BPE tokenizers trained
with `tokenizers` on this Python's standard library sources (32 MB with its tests and docs), at 32,000
and 128,000 tokens, cached under --tokenizer-dir (built once, ~10 s each). The 2-core test machine is
shared and noisy: compare libraries within one run; rounds (--repeats) interleave the libraries.

    python bench/grammar_masks.py [--vocabs 32000 128000] [--batches 1 64 256 1000] [--steps 5]
        [--warmup 5] [--repeats 1] [--libraries llguidance xgrammar outlines] [--grammars ...]
        [--threads N] [--tokenizer-dir DIR] [--outlines-timeout 60] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_lightning.grammar import (
    GrammarCompiler,
    GrammarSpec,
    GrammarVocabulary,
    accept_tokens,
    apply_token_bitmask,
    fill_bitmask,
    set_mask_threads,
)

SPECIALS = ["<unk>", "<s>", "</s>"]
EOS = 2
MAX_LEN = 256  # a sequence longer than this starts over: a step's batch mixes fresh and deep states
BASE_ROWS = 64

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "status": {"enum": ["active", "inactive", "banned"]},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 60},
                "city": {"type": "string", "maxLength": 40},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    },
    "required": ["name", "age", "status", "address", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z][a-z0-9._]{0,30}@[a-z]{1,20}\.(com|org|net)"
CHOICES = ["positive", "negative", "neutral", "mixed"]
GRAMMARS = {
    "json_object": GrammarSpec.json_object(),
    "json_schema": GrammarSpec.json_schema(SCHEMA),
    "regex": GrammarSpec.regex(REGEX),
    "choice": GrammarSpec.choice(CHOICES),
}


# ---- tokenizers ---------------------------------------------------------------------------------------
def corpus() -> list[str]:
    """The standard library's sources, tests and docs: 32 MB, the same on every machine with this Python
    (a site-packages corpus would change with what is installed)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*")
        if p.suffix in (".py", ".txt", ".html", ".rst") and "site-packages" not in p.parts and p.is_file()
    )
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def bench_tokenizer(vocab_size: int, cache_dir: Path) -> Tokenizer:
    path = cache_dir / f"stdlib-bpe-{vocab_size}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok


def byte_level_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character a byte-level BPE writes for each byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


# ---- the three libraries behind one interface ---------------------------------------------------------
class Llguidance:
    """Through moe_lightning.grammar: what the head runs."""

    name = "llguidance"

    def __init__(self, tok: Tokenizer, vocab_size: int, threads: int) -> None:
        set_mask_threads(threads)
        self.compiler = GrammarCompiler(GrammarVocabulary(tok, vocab_size, [EOS]))

    def compile(self, spec: GrammarSpec) -> Any:
        return self.compiler.compile(spec)

    def new(self, compiled: Any) -> Any:
        return compiled.new_state()

    def fill(self, states: list[Any], bitmask: torch.Tensor) -> None:
        fill_bitmask(states, bitmask)

    def accept(self, states: list[Any], tokens: list[int]) -> None:
        accept_tokens(states, tokens)

    def done(self, state: Any, token: int) -> bool:
        return state.is_terminated


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer, vocab_size: int, threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        encoded = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
        info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=[EOS])
        # its defaults are half the hardware threads: one on a 2-core machine
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, spec: GrammarSpec) -> Any:
        kind = spec.kind.value
        if kind == "json_object":
            return self.compiler.compile_builtin_json_grammar()
        if kind == "json_schema":
            # whitespace as ours: any, at most 32 characters a gap (moe_lightning/grammar/compiler.py)
            return self.compiler.compile_json_schema(spec.source, any_whitespace=True, max_whitespace_cnt=32)
        if kind == "regex":
            return self.compiler.compile_regex(spec.source)
        if kind == "choice":
            return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.parsed()))
        raise ValueError(kind)

    def new(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, states: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(states, bitmask)

    def accept(self, states: list[Any], tokens: list[int]) -> None:
        ok = self.xgr.BatchGrammarMatcher.batch_accept_token(states, tokens)
        if not all(ok):
            raise RuntimeError(f"xgrammar rejected {ok.count(False)} masked tokens")

    def done(self, state: Any, token: int) -> bool:
        return state.is_terminated()


class Outlines:
    """Regexes compiled to a token-level automaton ahead of time; JSON through its schema-to-regex.

    Each compile runs in a child process under a time and memory limit: outlines-core's automaton can
    explode (the e-mail regex here ran 11.5 minutes and grew to 18 GB on the 2-core machine before
    failing), which the shared machine must not pay. The child pickles the index back."""

    name = "outlines"
    timeout_s = 60.0
    memory_bytes = 4 << 30

    def __init__(self, tok: Tokenizer, vocab_size: int, threads: int, tokenizer_dir: Path | None = None) -> None:
        import outlines_core

        self.oc = outlines_core
        self.vocab_size = vocab_size
        self.tokenizer_dir = tokenizer_dir
        dec = byte_level_decoder()
        table: dict[bytes, list[int]] = {}
        for i in range(tok.get_vocab_size()):
            piece = tok.id_to_token(i)
            if piece in SPECIALS:
                continue
            table.setdefault(bytes(dec[c] for c in piece), []).append(i)
        self.vocabulary = outlines_core.Vocabulary(EOS, table)
        self.compiled: dict[GrammarSpec, tuple[float, Any]] = {}

    def compile_here(self, spec: GrammarSpec) -> Any:
        kind = spec.kind.value
        schema = {"json_object": '{"type": "object"}', "json_schema": spec.source}.get(kind)
        if schema is not None:
            regex = self.oc.json_schema.build_regex_from_schema(schema)
        elif kind == "regex":
            regex = spec.source
        else:
            regex = "(" + "|".join(re.escape(c) for c in spec.parsed()) + ")"
        return self.oc.Index(regex, self.vocabulary)

    def compile(self, spec: GrammarSpec) -> Any:
        if spec not in self.compiled:
            self.compiled[spec] = self._compile_in_child(spec)
        return self.compiled[spec][1]

    def compile_seconds(self, spec: GrammarSpec) -> float:
        return self.compiled[spec][0]

    def _compile_in_child(self, spec: GrammarSpec) -> tuple[float, Any]:
        grammar = next(name for name, g in GRAMMARS.items() if g == spec)
        limit = self.memory_bytes

        def limit_memory() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "index.pickle"
            argv = [sys.executable, __file__, "--outlines-child", str(self.vocab_size), grammar, str(out)]
            argv += ["--tokenizer-dir", str(self.tokenizer_dir)]
            try:
                done = subprocess.run(
                    argv, capture_output=True, text=True, timeout=self.timeout_s, preexec_fn=limit_memory
                )
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"no index within {self.timeout_s:.0f} s (killed)") from None
            if done.returncode != 0:
                tail = (done.stderr.strip().splitlines() or ["?"])[-1]
                raise RuntimeError(f"child failed (rc {done.returncode}, {limit >> 30} GB cap): {tail}")
            with out.open("rb") as f:
                return pickle.load(f)

    def new(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, states: list[Any], bitmask: torch.Tensor) -> None:
        words = bitmask.shape[1]
        for i, guide in enumerate(states):
            guide.write_mask_into(bitmask[i].data_ptr(), words, 4)

    def accept(self, states: list[Any], tokens: list[int]) -> None:
        for guide, token in zip(states, tokens, strict=True):
            if token != EOS:  # the stop token is no transition of its index
                guide.advance(token, return_tokens=False)

    def done(self, state: Any, token: int) -> bool:
        return token == EOS


def outlines_child(vocab_size: int, grammar: str, out: Path, tokenizer_dir: Path) -> int:
    lib = Outlines(bench_tokenizer(vocab_size, tokenizer_dir), vocab_size, 1)
    t0 = time.perf_counter()
    index = lib.compile_here(GRAMMARS[grammar])
    seconds = time.perf_counter() - t0
    with out.open("wb") as f:
        pickle.dump((seconds, index), f)
    return 0


LIBRARIES = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines": Outlines}
MODULES = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines": "outlines_core"}


def import_cost(library: str) -> dict[str, Any]:
    """Import time in a fresh interpreter, and whether it drags in transformers / triton / torch."""
    code = (
        f"import sys, time; t = time.perf_counter(); import {MODULES[library]}; t = time.perf_counter() - t; "
        "print(t, *(n in sys.modules for n in ('transformers', 'triton', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return {
        "import_s": float(out[0]),
        "imports_transformers": out[1] == "True",
        "imports_triton": out[2] == "True",
        "imports_torch": out[3] == "True",
    }


# ---- measurement --------------------------------------------------------------------------------------
def ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def compile_cost(lib: Any, spec: GrammarSpec, words: int) -> dict[str, float]:
    t0 = time.perf_counter()
    compiled = lib.compile(spec)
    t1 = time.perf_counter()
    if isinstance(lib, Outlines):  # compiled in a child: its own time, not the process start's
        t0, t1 = 0.0, lib.compile_seconds(spec)
    state = lib.new(compiled)
    bitmask = torch.zeros((1, words), dtype=torch.int32)
    t2 = time.perf_counter()
    lib.fill([state], bitmask)
    t3 = time.perf_counter()
    n = 50
    for _ in range(n):
        lib.new(compiled)
    t4 = time.perf_counter()
    return {"compile_ms": ms(t1 - t0), "first_mask_ms": ms(t3 - t2), "new_state_us": round((t4 - t3) / n * 1e6, 1)}


def run_steps(
    lib: Any, compiled: Any, batch: int, base: torch.Tensor, steps: int, warmup: int, seed: int
) -> dict[str, list[float]]:
    vocab = base.shape[1]
    words = (vocab + 31) // 32
    gen = torch.Generator().manual_seed(seed)
    states = [lib.new(compiled) for _ in range(batch)]
    lengths = [0] * batch
    logits = torch.empty((batch, vocab))
    bitmask = torch.empty((batch, words), dtype=torch.int32)
    out: dict[str, list[float]] = {"fill": [], "apply": [], "accept": [], "step": []}
    for step in range(warmup + steps):
        torch.index_select(base, 0, torch.randint(0, base.shape[0], (batch,), generator=gen), out=logits)
        t0 = time.perf_counter()
        lib.fill(states, bitmask)
        t1 = time.perf_counter()
        apply_token_bitmask(logits, bitmask)
        t2 = time.perf_counter()
        tokens = logits.argmax(dim=1).tolist()
        t3 = time.perf_counter()
        lib.accept(states, tokens)
        t4 = time.perf_counter()
        for b, token in enumerate(tokens):
            lengths[b] += 1
            if lib.done(states[b], token) or lengths[b] >= MAX_LEN:
                states[b], lengths[b] = lib.new(compiled), 0
        if step >= warmup:
            for key, dt in (("fill", t1 - t0), ("apply", t2 - t1), ("accept", t4 - t3), ("step", t2 - t0 + t4 - t3)):
                out[key].append(dt)
    return out


def apply_kernels(batch: int, vocab: int, repeats: int) -> dict[str, float]:
    """Ours against xgrammar's CPU kernel on the same half-full random bitmask (the mask's content does
    not change either's cost)."""
    words = (vocab + 31) // 32
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32, generator=gen)
    logits = torch.randn((batch, vocab), generator=gen)
    out = {}
    kernels = {"ours": lambda: apply_token_bitmask(logits, bitmask)}
    try:
        import xgrammar

        kernels["xgrammar_cpu"] = lambda: xgrammar.apply_token_bitmask_inplace(logits, bitmask, backend="cpu")
    except ImportError:
        pass
    for name, kernel in kernels.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            kernel()
            times.append(time.perf_counter() - t0)
        out[name] = ms(statistics.median(times))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128000])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256, 1000])
    ap.add_argument("--grammars", nargs="+", default=list(GRAMMARS), choices=list(GRAMMARS))
    ap.add_argument("--libraries", nargs="+", default=list(LIBRARIES), choices=list(LIBRARIES))
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first, so the batch spreads over states")
    ap.add_argument("--repeats", type=int, default=1, help="rounds, each running every library once")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="fill / compile threads")
    ap.add_argument("--tokenizer-dir", type=Path, default=Path(tempfile.gettempdir()) / "moe-lightning-grammar-bench")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--outlines-timeout", type=float, default=Outlines.timeout_s, help="seconds per outlines compile")
    ap.add_argument("--outlines-child", nargs=3, metavar=("VOCAB", "GRAMMAR", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.outlines_child:
        vocab, grammar, out = args.outlines_child
        return outlines_child(int(vocab), grammar, Path(out), args.tokenizer_dir)
    Outlines.timeout_s = args.outlines_timeout
    torch.set_num_threads(args.threads)

    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "imports": {}, "vocabs": {}}
    for name in args.libraries:
        results["imports"][name] = cost = import_cost(name)
        heavy = [n for n in ("transformers", "triton", "torch") if cost[f"imports_{n}"]]
        print(f"import {name}: {cost['import_s'] * 1e3:.0f} ms, pulls in {', '.join(heavy) or 'nothing heavy'}")

    for vocab in args.vocabs:
        tok = bench_tokenizer(vocab, args.tokenizer_dir)
        words = (vocab + 31) // 32
        entry: dict[str, Any] = {"tokenizer_build_ms": {}, "compile": {}, "steps": {}, "apply_kernels": {}}
        results["vocabs"][str(vocab)] = entry
        libs = {}
        for name in args.libraries:
            t0 = time.perf_counter()
            libs[name] = (
                Outlines(tok, vocab, args.threads, args.tokenizer_dir)
                if name == "outlines"
                else LIBRARIES[name](tok, vocab, args.threads)
            )
            entry["tokenizer_build_ms"][name] = ms(time.perf_counter() - t0)
        print(f"\nvocab {vocab}: tokenizer adapter build ms {entry['tokenizer_build_ms']}")
        print(f"{'grammar':12s} {'library':11s} {'compile ms':>10s} {'1st mask ms':>11s} {'new state us':>12s}")
        compiled = {}
        for g in args.grammars:
            for name, lib in libs.items():
                try:
                    cost = compile_cost(lib, GRAMMARS[g], words)
                    compiled[g, name] = lib.compile(GRAMMARS[g])  # the library's or our cache
                except Exception as exc:
                    cost = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                entry["compile"].setdefault(g, {})[name] = cost
                cells = (
                    f"{cost['compile_ms']:10.1f} {cost['first_mask_ms']:11.2f} {cost['new_state_us']:12.1f}"
                    if "error" not in cost
                    else cost["error"]
                )
                print(f"{g:12s} {name:11s} {cells}", flush=True)

        base = torch.randn((BASE_ROWS, vocab), generator=torch.Generator().manual_seed(vocab))
        print("\nper step, median ms: step = fill + apply + accept (apply: the same kernel for all)")
        print(f"{'grammar':12s} {'B':>5s}  " + "  ".join(f"{n + ' step (fill/apply/accept)':>38s}" for n in libs))
        for g in args.grammars:
            for batch in args.batches:
                runs: dict[str, dict[str, list[float]]] = {n: {} for n in libs}
                for r in range(args.repeats):
                    for name, lib in libs.items():
                        if (g, name) not in compiled:
                            continue
                        one = run_steps(lib, compiled[g, name], batch, base, args.steps, args.warmup, seed=r)
                        for key, values in one.items():
                            runs[name].setdefault(key, []).extend(values)
                row = {n: {k: ms(statistics.median(v)) for k, v in run.items()} for n, run in runs.items() if run}
                entry["steps"].setdefault(g, {})[str(batch)] = row
                cells = []
                for name in libs:
                    m = row.get(name)
                    text = f"{m['step']:.2f} ({m['fill']:.2f}/{m['apply']:.2f}/{m['accept']:.2f})" if m else "-"
                    cells.append(f"{text:>38s}")
                print(f"{g:12s} {batch:5d}  " + "  ".join(cells), flush=True)
        for batch in args.batches:
            entry["apply_kernels"][str(batch)] = apply_kernels(batch, vocab, max(3, args.steps))
        print(f"apply kernels, median ms by B: {entry['apply_kernels']}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
