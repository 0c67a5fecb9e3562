"""Specs to compiled grammars (cached) and each sequence's matcher state, on llguidance."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from moe_lightning.grammar.limits import (
    EXCEEDS,
    MAX_PROBED_PATTERNS,
    heap_bytes,
    parser_limits,
    schema_patterns,
    start_matcher,
)
from moe_lightning.grammar.spec import GrammarError, GrammarKind, GrammarSpec

if TYPE_CHECKING:
    import llguidance

    from moe_lightning.grammar.vocabulary import GrammarVocabulary

# Whitespace between JSON tokens: what JSON allows, at most 32 characters a gap. Unbounded whitespace
# lets a model that has lost the thread emit newlines until max_tokens (the failure vLLM added
# `disable-any-whitespace` for); no whitespace at all forbids the pretty-printed JSON models are
# trained on. 32 covers a newline plus 7 levels of 4-space indentation.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,32}"

# llguidance's JSON options, forced over any "x-guidance" a client put in its schema: strict (an
# unsupported keyword is an error, not silently ignored), oneOf only where the branches are disjoint
JSON_OPTIONS: dict[str, Any] = {"whitespace_pattern": JSON_WHITESPACE, "lenient": False, "coerce_one_of": False}

MAX_ERROR_CHARS = 1000  # an HTTP 400's message, not a dump of the parser
# The cache's bound (GrammarCompiler): the compiled grammars' estimated bytes, and a floor per grammar
# (a small one's matcher, its grammar and its lexer's first tables measure ~20-100 kB).
CACHE_BYTES = 128 * 2**20
MIN_GRAMMAR_BYTES = 64 * 1024


def grammar_text(spec: GrammarSpec, special_tokens: dict[str, int] | None = None) -> str:
    """The llguidance grammar (its JSON form, or Lark) for a spec; checks nothing. `special_tokens`:
    the vocabulary's, by text; a tool-call format's markers that are one of them are that token."""
    import llguidance

    match spec.kind:
        case GrammarKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        case GrammarKind.JSON_SCHEMA:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, overrides=JSON_OPTIONS)
        case GrammarKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(spec.source)
        case GrammarKind.CHOICE:
            # literals, not a regex of escaped alternatives: nothing in a choice is syntax. Each distinct
            # once: every alternative is an item of the parser's row, a repeated one too
            choices = dict.fromkeys(spec.parsed())
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(_lark_literal, choices)))
        case GrammarKind.TOOL_CALLS:
            return llguidance.LLMatcher.grammar_from_lark(_tool_calls_lark(spec.parsed(), special_tokens or {}))
    raise AssertionError(spec.kind)


def _lark_literal(text: str) -> str:
    # a JSON string with every non-ASCII character escaped is a valid Lark literal
    return json.dumps(text, ensure_ascii=True)


def _lark_text(text: str, special_tokens: dict[str, int]) -> str:
    """`text` as a Lark sequence: literals, and each special token in it as the token itself (`<[id]>`).
    llguidance's mask allows a special token where quoted text spells it, then refuses that token when
    it is consumed (it matches no text): a forced harmony header failed on its first token."""
    if not special_tokens:
        return _lark_literal(text)
    pattern = "|".join(re.escape(t) for t in sorted(special_tokens, key=len, reverse=True))
    parts = []
    for piece in re.split(f"({pattern})", text):
        if piece in special_tokens:
            parts.append(f"<[{special_tokens[piece]}]>")
        elif piece:
            parts.append(_lark_literal(piece))
    return " ".join(parts)


def _tool_calls_lark(spec: dict[str, Any], special_tokens: dict[str, int]) -> str:
    """begin call (separator call)* end, each call a JSON value of the schema (Lark's %json); a null
    separator: begin call end."""
    schema = {**spec["schema"], "x-guidance": JSON_OPTIONS}
    parts = [_lark_text(spec["begin"], special_tokens)] if spec["begin"] else []
    parts.append("call")
    separator = spec["separator"]
    if separator is not None:  # None: exactly one call
        parts.append(f"({_lark_text(separator, special_tokens)} call)*" if separator else "call*")
    if spec["end"]:
        parts.append(_lark_text(spec["end"], special_tokens))
    return f"start: {' '.join(parts)}\ncall: %json {json.dumps(schema)}\n"


def _error(spec: GrammarSpec, message: str) -> GrammarError:
    message = message.strip()
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + "..."
    return GrammarError(f"{spec.kind} grammar: {message}")


def check_grammar(spec: GrammarSpec) -> None:
    """Raises GrammarError for a spec the library cannot compile, without a vocabulary: for a process
    that has no tokenizer loaded. GrammarCompiler.check also checks against the model's tokens."""
    import llguidance

    try:
        text = grammar_text(spec)
    except ValueError as exc:
        raise _error(spec, str(exc)) from None
    message = llguidance.LLMatcher.validate_grammar(text, None, limits=parser_limits())
    if message:
        raise _error(spec, message)


def _heavy_pattern(spec: GrammarSpec, vocabulary: GrammarVocabulary) -> str | None:
    """Why one of a schema's patterns exceeds a limit, probed alone as a string's (limits.probe reaches
    only the grammar's first tokens; a pattern deeper in would fail the step that reaches it)."""
    if spec.kind not in (GrammarKind.JSON_SCHEMA, GrammarKind.TOOL_CALLS):
        return None
    schema = spec.parsed()
    for pattern in schema_patterns(schema if spec.kind == GrammarKind.JSON_SCHEMA else schema["schema"])[
        :MAX_PROBED_PATTERNS
    ]:
        try:
            text = grammar_text(GrammarSpec.json_schema({"type": "string", "pattern": pattern}))
        except ValueError:  # the whole schema compiles; this alone is not for us to judge
            continue
        why = start_matcher(vocabulary._ll, text, vocabulary.vocab_size, vocabulary.stop_token_ids)
        if isinstance(why, str) and why.startswith(EXCEEDS):
            return f"its pattern {pattern[:80]!r}: {why}"
    return None


class CompiledGrammar:
    """A spec compiled for one vocabulary. Holds a matcher at the start state that each sequence's
    state copies (a copy is ~10 µs and shares the lexer's lazily built tables, where a new matcher
    rebuilds them: ~1 ms for a 30-property schema). Compiling it computes its first mask and tries its
    first tokens (limits.probe): a grammar that the library would fail at its first step, or that no
    output can match, raises GrammarError here, before any request with it is admitted."""

    __slots__ = ("_template", "nbytes", "spec", "vocabulary", "warnings")

    def __init__(self, spec: GrammarSpec, vocabulary: GrammarVocabulary) -> None:
        try:
            text = grammar_text(spec, vocabulary.special_tokens)
        except ValueError as exc:  # a schema the library's JSON reader refuses
            raise _error(spec, str(exc)) from None
        heavy = _heavy_pattern(spec, vocabulary)
        if heavy is not None:
            raise _error(spec, heavy)
        before = heap_bytes()
        matcher = start_matcher(vocabulary._ll, text, vocabulary.vocab_size, vocabulary.stop_token_ids)
        if isinstance(matcher, str):
            raise _error(spec, matcher)
        # what the compile and the first masks kept on the heap: the cache's measure of this grammar
        # (its lexer grows later as sequences use it, up to the lexer's state limit)
        self.nbytes = max(heap_bytes() - before, MIN_GRAMMAR_BYTES)
        self.spec = spec
        self.vocabulary = vocabulary
        self.warnings: list[str] = matcher.get_grammar_warnings()
        self._template = matcher

    def new_state(self, replay: Iterable[int] = ()) -> GrammarState:
        """A sequence's state at the start, then through `replay` (the tokens a preempted sequence had
        generated, re-prefilled: its mask continues where it left off)."""
        state = GrammarState(self)
        state.replay(replay)
        return state


class GrammarStateError(RuntimeError):
    """A token the grammar did not allow was accepted: the mask was not applied, or not this one's."""


class GrammarState:
    """One sequence's position in its grammar. Not thread-safe: the head owns it."""

    __slots__ = ("_matcher", "_terminated", "error", "grammar", "num_tokens")

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        self._matcher: llguidance.LLMatcher = grammar._template.deep_copy()
        self._terminated = False
        self.num_tokens = 0  # tokens accepted, stop token included
        # the library's message when it failed mid-sequence (a parser or lexer limit): from then on the
        # mask allows only the stop tokens, and the head can report why the output stopped early
        self.error: str | None = None

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: the output is complete and matches the grammar."""
        return self._terminated

    @property
    def is_accepting(self) -> bool:
        """The text so far is a complete match (a stop token is allowed now)."""
        return self._matcher.is_accepting()

    def accept(self, token_id: int) -> None:
        if self._consumes(token_id):
            self._record(token_id, self._matcher.consume_token(token_id))
        else:
            self._record(token_id, True)

    def replay(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.accept(t)

    def _consumes(self, token_id: int) -> bool:
        """Whether the token goes to the library (False: a failed state ending on a stop token)."""
        if self._terminated:
            raise GrammarStateError(f"token {token_id} after the grammar terminated")
        if not self._matcher.is_error():
            return True
        # the library failed computing the last mask (a parser or lexer limit); that mask allowed only
        # the stop tokens, so the sequence ends here rather than running unconstrained
        if self.error is None:
            self.error = self._matcher.get_error()
        if token_id not in self.grammar.vocabulary.stop_token_ids:
            raise GrammarStateError(f"token {token_id} after the grammar failed: {self.error}")
        return False

    def _record(self, token_id: int, ok: bool) -> None:
        if not ok:
            raise GrammarStateError(
                f"{self.grammar.spec.kind} grammar rejected token {token_id} after {self.num_tokens} tokens: "
                f"{self._matcher.get_error()}"
            )
        self.num_tokens += 1
        self._terminated = token_id in self.grammar.vocabulary.stop_token_ids


class GrammarCompiler:
    """Compiles specs for one vocabulary, keeping the most recently used while their estimated bytes
    (CompiledGrammar.nbytes) stay within `cache_bytes` and they number at most `cache_size` (a compile
    is cheap with llguidance, ~0.1-2 ms, since it builds lexer tables lazily, but requests repeat their
    schema). A grammar that fails is never kept. Thread-safe."""

    def __init__(self, vocabulary: GrammarVocabulary, cache_size: int = 256, cache_bytes: int = CACHE_BYTES) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        if cache_bytes < 1:
            raise ValueError(f"cache_bytes must be >= 1, got {cache_bytes}")
        self.vocabulary = vocabulary
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        # Compiles run one at a time (each is bounded by the lexer's fuel: ~0.1 s at worst), so the heap's
        # growth while one runs is its own, and on one thread, so their memory comes from one malloc
        # arena, where the room an evicted grammar frees is what the next one takes (on the API's
        # threads, each with an arena of its own, the orchestrator settled 26 MiB higher in
        # tests/test_grammar_admission_e2e.py's 50 lexer-heavy grammars).
        self._compile_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self.nbytes = 0  # the cached grammars' estimated bytes
        self.hits = 0
        self.misses = 0

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                return compiled
            self.misses += 1
        # outside the cache's lock: lookups of cached specs need not wait for a compile
        compiled = self._compile_thread.submit(CompiledGrammar, spec, self.vocabulary).result()
        with self._lock:
            old = self._cache.pop(spec, None)  # two threads compiled it at once: one is kept
            self.nbytes -= old.nbytes if old is not None else 0
            self._cache[spec] = compiled
            self.nbytes += compiled.nbytes
            # the least recent go first; one larger than the whole bound is not kept (its request has it)
            while self._cache and (self.nbytes > self.cache_bytes or len(self._cache) > self.cache_size):
                self.nbytes -= self._cache.popitem(last=False)[1].nbytes
        return compiled

    def check(self, spec: GrammarSpec) -> None:
        """Raises GrammarError before a request is admitted; the compiled grammar stays cached for it."""
        self.compile(spec)

    def __len__(self) -> int:
        return len(self._cache)
