"""A request's output as it is generated: when it is done (EOS, a stop string, its token budget), its
final text, and the text a stream may send so far -- from one incremental decode of its tokens.

The stream's text pieces (deltas) hold back text that could still turn out to be the start of a stop
string and never include a stop string, and they add up to exactly the final text: the delta returned
with the finishing token completes it. The final text itself is the whole output decoded once at the
end, as a client decoding the returned token ids would get it (the incremental text can lag it by a
partial UTF-8 character), without a closing EOS token, cut before the earliest stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from moe_lightning.detokenize import IncrementalDetokenizer, first_stop
from moe_lightning.request import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, GenerationRequest, InvalidRequestError
from moe_lightning.tokenizer import TextTokenizer
from moe_lightning.validation import STOP_NEEDS_TOKENIZER


class OutputText:
    def __init__(
        self,
        request: GenerationRequest,
        eos_ids: Sequence[int],
        tokenizer: TextTokenizer | None,
        *,
        stream: bool = False,
    ) -> None:
        """stream: compute the deltas of every token. Without it (and without stop strings) nothing is
        decoded until the end, and the finishing token's delta is the whole text."""
        if request.stop and tokenizer is None:  # validation refuses this first; a stop could never match
            raise InvalidRequestError(STOP_NEEDS_TOKENIZER)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._max_new_tokens = request.max_new_tokens
        self._stops = request.stop
        self._longest = max((len(s) for s in request.stop), default=0)
        self._eos = frozenset(() if request.ignore_eos else eos_ids)
        self._tokenizer = tokenizer
        self._stream = stream
        decode = tokenizer is not None and (stream or bool(request.stop))
        self._detok = IncrementalDetokenizer(tokenizer) if decode and tokenizer is not None else None
        self._final: str | None = None  # the final text, once known
        self._sent = ""  # what the deltas returned so far add up to

    def append(self, token: int) -> tuple[str, str | None]:
        """Adds the next generated token; returns (the text a stream may send now, the finish reason or
        None while the output goes on)."""
        if self.finish_reason is not None:
            raise ValueError(f"the output already finished ({self.finish_reason})")
        self.token_ids.append(token)
        self.finish_reason = self._check(token)
        if self.finish_reason is not None:
            return self._send(self.final_text or ""), self.finish_reason
        if not self._stream or self._detok is None:
            return "", None
        text = self._detok.text  # holds no stop string: the check would have finished the output
        return self._send(text[: len(text) - self._held(text)]), None

    @property
    def final_text(self) -> str | None:
        """The output's text (so far, before it finishes); None without a tokenizer."""
        if self._final is not None:
            return self._final
        if self._tokenizer is None:
            return None
        ids = self.token_ids[:-1] if self.finish_reason == FINISH_EOS else self.token_ids
        text = self._tokenizer.decode(ids)
        if self.finish_reason is not None:
            self._final = text  # decoded once: the result and the last delta both read it
        return text

    def _check(self, token: int) -> str | None:
        if token in self._eos:  # not decoded: EOS is no part of the text
            return FINISH_EOS
        if self._detok is not None:
            searched = len(self._detok.text)
            self._detok.push([token])
            if self._stops:
                # only the newest text can complete a stop string: search from one stop's length back
                hit = first_stop(self._detok.text, self._stops, max(0, searched - self._longest + 1))
                if hit >= 0:
                    assert self._tokenizer is not None  # _detok exists only with one
                    # the output text is the whole output decoded, cut at the stop; the incremental
                    # text is the fallback should the whole decode not show the stop
                    text = self._tokenizer.decode(self.token_ids)
                    cut = first_stop(text, self._stops)
                    self._final = text[:cut] if cut >= 0 else self._detok.text[:hit]
                    return FINISH_STOP
        if len(self.token_ids) >= self._max_new_tokens:
            return FINISH_LENGTH
        return None

    def _send(self, upto: str) -> str:
        """The part of `upto` not sent yet. Nothing when `upto` does not extend what was sent: a delta
        cannot be taken back (only a whole decode that disagrees with the incremental one does that)."""
        if len(upto) <= len(self._sent) or not upto.startswith(self._sent):
            return ""
        delta, self._sent = upto[len(self._sent) :], upto
        return delta

    def _held(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for n in range(min(len(text), self._longest - 1), 0, -1):
            if any(s.startswith(text[-n:]) for s in self._stops):
                return n
        return 0
