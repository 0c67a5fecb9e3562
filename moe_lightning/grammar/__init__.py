"""Structured outputs: token masks that make a sequence's output match a grammar (JSON object, JSON
schema, regex, choice, tool calls), on llguidance. Why this library, the numbers and how the pieces fit
the head: docs/structured-outputs.md.

Importing this package costs neither torch nor the library: the API process validates specs
(`GrammarSpec`, `check_grammar`) and only the head builds a vocabulary and masks logits.

    vocab = GrammarVocabulary(tokenizer, vocab_size=spec.vocab_size, stop_token_ids=[eos])
    compiler = GrammarCompiler(vocab)
    state = compiler.compile(GrammarSpec.json_schema(schema)).new_state()
    apply_grammar_masks(logits, [state, None, ...])  # (B, V), in place, before sampling
    accept_tokens([state, None, ...], sampled)       # or state.accept(token)
"""

from moe_lightning.grammar.compiler import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarState,
    GrammarStateError,
    check_grammar,
)
from moe_lightning.grammar.masks import (
    accept_tokens,
    apply_grammar_masks,
    apply_token_bitmask,
    fill_bitmask,
    set_mask_threads,
)
from moe_lightning.grammar.spec import MAX_CHOICES, MAX_SOURCE_CHARS, GrammarError, GrammarKind, GrammarSpec
from moe_lightning.grammar.vocabulary import GrammarVocabulary

__all__ = [
    "MAX_CHOICES",
    "MAX_SOURCE_CHARS",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarKind",
    "GrammarSpec",
    "GrammarState",
    "GrammarStateError",
    "GrammarVocabulary",
    "accept_tokens",
    "apply_grammar_masks",
    "apply_token_bitmask",
    "check_grammar",
    "fill_bitmask",
    "set_mask_threads",
]
