"""What one grammar may cost (docs/structured-outputs.md, "Limits"): the library's per-grammar limits,
the check that a compiled grammar can start (its first mask and its first tokens, computed before the
request is admitted), and the estimate of the memory it keeps, by which the compiler's cache is bounded.

A grammar that passes `probe` has already computed what a step computes first, so what the library
would refuse at the first step (a limit, a language with no text in it) is a 400 at admission instead
of a failed step."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import llguidance

# The lexer's fuel to build its tables and compute the first mask (llguidance's unit: ~50 per µs).
# The library's default, 1,000,000, lets a 40-byte regex such as (a{1000}){1000} build ~200 MB of
# derivatives at the first mask, which the cache then pins; 100,000 bounds that at ~12 MB and ~0.1 s.
# Schemas of 60 properties, 800-value enums, date-time/email/uuid formats and 3,000-character strings
# on a 32,000-token vocabulary stay within it for 3,000 tokens (docs/structured-outputs.md, "Limits").
INITIAL_LEXER_FUEL = 100_000
# The lexer's states, built lazily while sequences generate (the library's estimate: 1-2 kB each; its
# default, 250,000, is up to 500 MB for one grammar). Ordinary grammars use hundreds.
MAX_LEXER_STATES = 20_000
# The parser's row limit (the library's default, named in its own error messages).
MAX_ITEMS_IN_ROW = 2_000
# How many of the first mask's tokens are each consumed on a copy (and the next mask computed) at
# admission: the lexer builds a token's derivatives when it consumes it, where a limit fails first.
PROBE_TOKENS = 4

# (what the library's message says, the limit it means, what spends it): for the 400
_REPEATS = "nested counted repetitions such as (a{1000}){1000} multiply"
LIMIT_NAMES = (
    ("too many expressions", f"the lexer's fuel ({INITIAL_LEXER_FUEL:,})", _REPEATS),
    ("too many states", f"the lexer's states ({MAX_LEXER_STATES:,})", _REPEATS),
    ("items; max is", f"the parser's items in a row ({MAX_ITEMS_IN_ROW:,})", "each alternative is one"),
)
# the library's error when no token can extend the text and the text is no match (the language is empty)
NOTHING_MATCHES = "NoExtensionBias"
EXCEEDS = "it exceeds "  # how a limit's 400 begins
# A schema's patterns are each probed alone, as a string's (their lexemes start deeper in the grammar
# than its first tokens reach): this many at most, each bounded by the fuel. Past them a limit is
# reached in generation, where it ends that sequence alone.
MAX_PROBED_PATTERNS = 32


def parser_limits() -> llguidance.LLParserLimits:
    import llguidance

    # verbose errors append the parser state and the whole grammar: noise in a 400, and in logs
    return llguidance.LLParserLimits(
        verbose_errors=False,
        initial_lexer_fuel=INITIAL_LEXER_FUEL,
        max_lexer_states=MAX_LEXER_STATES,
        max_items_in_row=MAX_ITEMS_IN_ROW,
    )


def start_matcher(
    tokenizer: llguidance.LLTokenizer, grammar: str, vocab_size: int, stop_token_ids: tuple[int, ...]
) -> llguidance.LLMatcher | str:
    """A grammar's matcher at its start state, its first masks computed (`probe`); or why it cannot
    start, the matcher then freed here: raised from where it is a local, it would live as long as the
    exception's traceback, which in a server's handlers is until the garbage collector finds the cycle
    (~8 MB a refused lexer-heavy grammar, measured: the orchestrator grew by that much per request)."""
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    if matcher.is_error():
        return matcher.get_error()
    why = probe(matcher, vocab_size, stop_token_ids)
    return matcher if why is None else why


def probe(matcher: llguidance.LLMatcher, vocab_size: int, stop_token_ids: tuple[int, ...]) -> str | None:
    """Why a grammar cannot start, or None: its first mask on `matcher` (at the start state; the tables
    it builds are shared by every copy), then each of the first PROBE_TOKENS text tokens it allows
    consumed on a copy and the mask after it computed."""
    allowed = _allowed(matcher, vocab_size)
    if matcher.is_error():
        return _why(matcher.get_error())
    # the first text tokens (a permissive mask allows most of a 150,000-token vocabulary: not all read)
    text = [t for t in allowed[: PROBE_TOKENS + len(stop_token_ids)] if t not in stop_token_ids]
    if not text and not matcher.is_accepting():
        return _why(NOTHING_MATCHES)
    for token in text[:PROBE_TOKENS]:
        copy = matcher.deep_copy()
        if copy.consume_token(int(token)):
            copy.compute_bitmask()
        if copy.is_error():
            return _why(copy.get_error())
    return None


def library_words(message: str) -> str:
    """llguidance's error without the marker its non-verbose mode leaves in it, for a client's message."""
    return message.replace("<non-verbose/>", "").strip()


def _allowed(matcher: llguidance.LLMatcher, vocab_size: int) -> list[int]:
    import numpy as np

    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size]).tolist()


def _why(message: str) -> str:
    if NOTHING_MATCHES in message:
        return (
            "no output can match it (its language is empty: a schema that only refers to itself, a $ref "
            "cycle, a regex that matches no string)"
        )
    message = library_words(message)
    for needle, limit, spent in LIMIT_NAMES:
        if needle in message:
            return f"{EXCEEDS}{limit} at its first tokens ({message}); simplify it: {spent}"
    return f"it fails at its first tokens: {message}"


def schema_patterns(schema: Any) -> list[str]:
    """The distinct regexes of a JSON schema (`pattern`, `patternProperties`' keys), in the order found."""
    found: dict[str, None] = {}
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found[node["pattern"]] = None
            if isinstance(node.get("patternProperties"), dict):
                found.update(dict.fromkeys(node["patternProperties"]))
            stack.extend(reversed(list(node.values())))
        elif isinstance(node, list):
            stack.extend(reversed(node))
    return list(found)


# ---- the memory a compiled grammar keeps ---------------------------------------------------------------
# glibc's struct mallinfo2, every field a size_t
MALLINFO2_FIELDS = [
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",
    "keepcost",
]


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2_FIELDS]


def _load_mallinfo2() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    fn.argtypes = []
    return fn


_MALLINFO2 = _load_mallinfo2()
_PAGE = os.sysconf("SC_PAGE_SIZE")


def heap_bytes() -> int:
    """Bytes the C heap holds in use (the library allocates through it): malloc's own count, which freed
    and reused memory does not blur as it does the resident size; the resident size where malloc
    cannot say (not glibc)."""
    if _MALLINFO2 is not None:
        info = _MALLINFO2()
        return int(info.uordblks + info.hblkhd)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE
