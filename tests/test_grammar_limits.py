"""What one grammar may cost (issue 54; moe_lightning/grammar/limits.py, docs/structured-outputs.md
"Limits"): a grammar that the library would fail at its first step, or that no output can match, is
refused when it is compiled (before its request is admitted), naming the limit; repeated choices are
one; the compiler's cache is bounded by its grammars' measured bytes and keeps no failed grammar."""

from __future__ import annotations

import re

import pytest
from tokenizers import Tokenizer

from moe_lightning.demo_model import build_tokenizer
from moe_lightning.grammar import (
    MAX_CHOICES,
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    GrammarVocabulary,
)
from moe_lightning.grammar.compiler import MIN_GRAMMAR_BYTES
from moe_lightning.grammar.limits import INITIAL_LEXER_FUEL

EOS = 2
NOTHING = "no output can match it"
FUEL = f"exceeds the lexer's fuel ({INITIAL_LEXER_FUEL:,})"
PATTERN = "^(a{1000}){1000}$"
# ~40-byte grammars whose first tokens build ~200 MB of lexer tables under the library's default fuel
HEAVY = [
    (GrammarSpec.regex("(a{1000}){1000}"), FUEL),
    (GrammarSpec.json_schema({"type": "string", "pattern": "^(a{1000}){1000}$"}), FUEL),
    # deeper than the first tokens reach: its patterns are probed alone
    (GrammarSpec.json_schema({"type": "object", "properties": {"x": {"type": "string", "pattern": PATTERN}}}), FUEL),
    (GrammarSpec.tool_calls({"type": "object", "patternProperties": {"^(a{1000}){1000}$": {"type": "integer"}}}), FUEL),
]
EMPTY = [
    (GrammarSpec.json_schema({"$ref": "#"}), NOTHING),
    (
        GrammarSpec.json_schema(
            {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
        ),
        NOTHING,
    ),
    (GrammarSpec.regex(r"[^\s\S]"), NOTHING),
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return build_tokenizer(512)


@pytest.fixture()
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(GrammarVocabulary(tokenizer, 520, [EOS]))


@pytest.mark.parametrize(
    ("spec", "says"),
    HEAVY + EMPTY,
    ids=["regex", "pattern", "nested-pattern", "tool-pattern-key", "ref", "cycle", "no-string"],
)
def test_a_grammar_that_cannot_start_is_refused_when_compiled(
    compiler: GrammarCompiler, spec: GrammarSpec, says: str
) -> None:
    """Today these compile, and the first step fails at the first token (the lexer's fuel) or the
    request answers empty text (no output matches)."""
    with pytest.raises(GrammarError, match=re.escape(says)) as info:
        compiler.check(spec)
    assert str(info.value).startswith(f"{spec.kind} grammar: ") and len(str(info.value)) < 1100
    assert len(compiler) == 0  # a failed grammar is never kept
    assert compiler.compile(GrammarSpec.choice([""])).new_state().is_accepting  # "" is a match, not nothing


def test_repeated_choices_are_one_and_their_count_is_bounded(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    """2,500 equal strings passed the parser's 2,000 items in a row at the first token."""
    state = compiler.compile(GrammarSpec.choice(["a"] * 2500)).new_state()
    state.replay([*tokenizer.encode("a", add_special_tokens=False).ids, EOS])
    assert state.is_terminated
    compiler.check(GrammarSpec.choice([f"item {i}" for i in range(MAX_CHOICES)]))
    with pytest.raises(GrammarError, match=f"1001 distinct choices, more than the {MAX_CHOICES} allowed"):
        GrammarSpec.choice([f"item {i}" for i in range(MAX_CHOICES + 1)])


def test_the_cache_is_bounded_by_its_grammars_bytes(tokenizer: Tokenizer) -> None:
    """Lexer-heavy grammars that pass (each keeps ~10-20 MB) evict the least recent within the bound;
    one larger than the whole bound is compiled for its request and not kept."""
    vocabulary = GrammarVocabulary(tokenizer, 520, [EOS])
    heavy = [GrammarSpec.regex(f"(a{{{150 + i}}}){{150}}") for i in range(4)]
    sizes = [GrammarCompiler(vocabulary).compile(s).nbytes for s in heavy[:1]]
    assert sizes[0] > 4 * 2**20  # measured: the lexer's tables of its first tokens
    compiler = GrammarCompiler(vocabulary, cache_bytes=int(2.5 * sizes[0]))
    kept = [compiler.compile(s) for s in heavy]
    assert compiler.nbytes <= compiler.cache_bytes and 1 <= len(compiler) < len(heavy)
    assert compiler.compile(heavy[-1]) is kept[-1]  # the most recent stays
    assert compiler.nbytes == sum(g.nbytes for g in compiler._cache.values())
    small = compiler.compile(GrammarSpec.choice(["x"]))
    assert small.nbytes >= MIN_GRAMMAR_BYTES
    tiny = GrammarCompiler(vocabulary, cache_bytes=MIN_GRAMMAR_BYTES)
    tiny.compile(heavy[0])
    assert len(tiny) == 0 and tiny.nbytes == 0
