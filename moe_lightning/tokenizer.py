"""The checkpoint's tokenizer.json, through the `tokenizers` library."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer

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

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)
