"""The model's vocabulary as the grammar library sees it: each token id's bytes, the logits' width and
the tokens that end a sequence."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from moe_lightning.tokenizer import TextTokenizer

if TYPE_CHECKING:
    import llguidance


class GrammarVocabulary:
    """Built once per model (about 0.3 s at 32k tokens, 1 s at 128k: the library walks every token's
    bytes into a trie), shared by every grammar compiled for it.

    `vocab_size` is the logits' width V, which may exceed the tokenizer's (embedding tables padded to a
    multiple of 64 or 128): ids past the tokenizer are never allowed. `stop_token_ids` are the model's
    EOS / end-of-turn ids: the only tokens allowed once a grammar is complete.

    The library reads tokenizer.json itself, as the model's runtime does, so byte-level BPE (Ġ for a
    space: GPT-2, Llama 3, Qwen, our demo tokenizers) and sentencepiece byte fallback (▁ for a space,
    <0x0A> for a byte: Llama 2, Mixtral) both map to the bytes the model actually emits. Special and
    added-special tokens (BOS, <|im_start|>) never match grammar text."""

    def __init__(self, tokenizer: TextTokenizer | Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import llguidance

        # TextTokenizer keeps its Tokenizer private; the library needs the tokenizer.json text
        tok = tokenizer._tok if isinstance(tokenizer, TextTokenizer) else tokenizer
        self.tokenizer_size = tok.get_vocab_size(with_added_tokens=True)
        if vocab_size < self.tokenizer_size:
            raise ValueError(
                f"the tokenizer has {self.tokenizer_size} tokens but the model's vocabulary has {vocab_size}"
            )
        stops = list(dict.fromkeys(int(t) for t in stop_token_ids))
        if not stops:
            raise ValueError("a grammar needs at least one stop token id (EOS) to end the sequence")
        bad = [t for t in stops if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop token ids {bad} are outside the vocabulary (0..{vocab_size - 1})")
        self.vocab_size = vocab_size
        self.stop_token_ids: tuple[int, ...] = tuple(stops)
        # a copy without padding or truncation: they would change how the library re-tokenizes text
        plain = Tokenizer.from_str(tok.to_str())
        plain.no_padding()
        plain.no_truncation()
        # special tokens by their text (harmony's <|channel|>, Mistral's [TOOL_CALLS]): a grammar that
        # writes one refers to the token itself, which quoted grammar text never matches
        self.special_tokens: dict[str, int] = {
            t.content: i for i, t in plain.get_added_tokens_decoder().items() if t.special and i < vocab_size
        }
        try:
            self._ll: llguidance.LLTokenizer = llguidance.LLTokenizer(
                plain.to_str(), n_vocab=vocab_size, eos_token=list(stops)
            )
        except Exception as exc:  # the library raises plain ValueError/RuntimeError for what it cannot read
            raise ValueError(f"the grammar library cannot read this tokenizer: {exc}") from exc

    @classmethod
    def from_file(cls, path: str | Path, vocab_size: int, stop_token_ids: Sequence[int]) -> GrammarVocabulary:
        return cls(Tokenizer.from_file(str(path)), vocab_size, stop_token_ids)

    @property
    def bitmask_words(self) -> int:
        """int32 words per row of a token bitmask: bit t % 32 of word t // 32 allows token t."""
        return (self.vocab_size + 31) // 32

    def token_bytes(self, token_ids: Sequence[int]) -> bytes:
        """What the tokens spell, as the grammar reads them (tests and error messages)."""
        return self._ll.decode_bytes(list(token_ids))
