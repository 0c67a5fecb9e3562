"""Text of a growing token sequence, decoded a few tokens at a time.

Decoding the whole output after every token costs O(n) per step (O(n^2) per request) and, for a
stop-string check or a text stream, is only needed near the end. The method (as vLLM and TGI do
it): decode a short window that starts a few tokens back (`prefix`), and take as new text what it
adds beyond the window's older part. Starting a few tokens back keeps tokenizers that treat the
first token specially (SentencePiece's leading space) and byte-level tokens that split a UTF-8
character exact: text that ends in U+FFFD (an incomplete character) is held until it completes.
"""

from __future__ import annotations

from collections.abc import Sequence

from moe_lightning.tokenizer import TextTokenizer

INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far
        self._prefix = 0  # the window starts here...
        self._read = 0  # ...and its text up to here is already in self.text

    def push(self, ids: Sequence[int]) -> str:
        """Appends tokens; returns the text they complete ("" while a character is still partial)."""
        self.ids.extend(ids)
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        window = self.tokenizer.decode(self.ids[self._prefix :])
        if len(window) <= len(before) or window.endswith(INCOMPLETE):
            return ""
        new = window[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += new
        return new


def first_stop(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Where the earliest stop string begins in text[start:] (an index into text), or -1."""
    return min((i for i in (text.find(s, start) for s in stops) if i >= 0), default=-1)
