"""The checkpoint's tokenizer.json, through the `tokenizers` library."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens

    def keeping_special_tokens(self) -> TextTokenizer:
        """The same tokenizer, decoding special tokens as text (a tool-call parser reads Mistral's
        [TOOL_CALLS] and Llama's <|python_tag|>, which are special tokens)."""
        return TextTokenizer(self._tok, skip_special_tokens=False)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> TextTokenizer | None:
        """None when the checkpoint ships no tokenizer.json (then only token ids work)."""
        path = Path(model_dir) / TOKENIZER_FILE
        if not path.is_file():
            return None
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as exc:  # the library raises plain Exception for a malformed file
            raise ValueError(f"{path}: cannot load tokenizer: {exc}") from exc

    def check_fits(self, vocab_size: int, where: str | Path = "") -> None:
        """A tokenizer with more tokens than the model's embedding rows is the wrong tokenizer (ids
        past the table would be rejected or, worse, read garbage): fail at start, naming both."""
        if self.vocab_size > vocab_size:
            raise ValueError(
                f"{Path(where) / TOKENIZER_FILE}: the tokenizer has {self.vocab_size} tokens but the model's "
                f"vocabulary has {vocab_size}: it belongs to another model"
            )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`add_special_tokens=False` for text that already carries them, such as a rendered chat
        template that writes its own BOS (a second one would shift the model off its training format)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip_special)
