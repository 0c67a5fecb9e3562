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


class StreamedText:
    """The text deltas of a streamed request. Text that could still turn out to be the start of a
    stop string is held back, and a stop string itself is never sent, so the deltas add up to
    exactly the final output text (which ends before the stop)."""

    def __init__(self, tokenizer: TextTokenizer | None, stops: Sequence[str]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stops = [s for s in stops if s]
        self.sent = ""

    def feed(self, ids: Sequence[int]) -> str:
        if self.detok is None:
            return ""
        self.detok.push(ids)
        text = self.detok.text
        end = first_stop(text, self.stops, max(0, len(self.sent) - max((len(s) for s in self.stops), default=0)))
        if end < 0:
            end = len(text) - self._held(text)
        return self._send(text[:end])

    def finish(self, final_text: str | None) -> str:
        """The rest of the final output text (all of it is safe now)."""
        return self._send(final_text or "")

    def _send(self, upto: str) -> str:
        if len(upto) <= len(self.sent) or not upto.startswith(self.sent):
            return ""
        delta, self.sent = upto[len(self.sent) :], upto
        return delta

    def _held(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for n in range(min(len(text), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stops):
                return n
        return 0
