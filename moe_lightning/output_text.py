"""A request's output as it is generated: when it is done (EOS, a stop string, its token budget), its
final text, and the text a stream may send so far -- from one incremental decode of its tokens.

The stream's text pieces (deltas) hold back text that could still turn out to be the start of a stop
string and never include a stop string, and they add up to exactly the final text: the delta returned
with the finishing token completes it. The final text itself is the whole output decoded once at the
end, as a client decoding the returned token ids would get it (the incremental text can lag it by a
partial UTF-8 character), without a closing EOS token, cut before the earliest stop string.

Per token, the stop search and the hold-back cost what the token's new text costs (times the number of
stop strings), whatever the output's length or the stops' lengths: a streaming KMP matcher per stop keeps
the length of the longest suffix of the text so far that is a prefix of that stop (issue 14, item 6: the
old hold-back rescanned up to a stop's length of text per token, 178 ms a token with a 1 MB stop).
"""

from __future__ import annotations

from collections.abc import Sequence

from moe_lightning.detokenize import IncrementalDetokenizer, first_stop
from moe_lightning.request import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, GenerationRequest, InvalidRequestError
from moe_lightning.tokenizer import TextTokenizer
from moe_lightning.validation import STOP_NEEDS_TOKENIZER


class StopMatcher:
    """Streaming KMP over the text as it grows: which stop strings the newest text completes, and how
    much of the text's end could still begin one. Each character costs O(1) per stop, amortised."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._fail = [_failure(s) for s in self._stops]
        self._state = [0] * len(self._stops)  # per stop: longest suffix of the text that is a prefix of it

    def feed(self, text: str) -> int:
        """Consumes the next piece of text; returns the index into `text` where the earliest stop string
        it completes begins (negative: that many characters before `text`), or NO_STOP."""
        earliest: int | None = None
        for j, stop in enumerate(self._stops):
            fail, state, size = self._fail[j], self._state[j], len(stop)
            for i, ch in enumerate(text):
                while state and stop[state] != ch:
                    state = fail[state - 1]
                if stop[state] == ch:
                    state += 1
                if state == size:
                    begin = i + 1 - size
                    if earliest is None or begin < earliest:
                        earliest = begin
                    break  # a later completion of the same stop begins later
            self._state[j] = state
        return NO_STOP if earliest is None else earliest

    @property
    def held(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        return max(self._state, default=0)


NO_STOP = 1 << 62  # StopMatcher.feed's "no stop completed" (a begin index can be negative, so not -1)


def _failure(stop: str) -> list[int]:
    """KMP's failure function: for each prefix of `stop`, its longest proper border."""
    fail = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return fail


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
        if tokenizer is not None and not request.skip_special_tokens:
            tokenizer = tokenizer.keeping_special_tokens()
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._max_new_tokens = request.max_new_tokens
        self._stops = request.stop
        self._matcher = StopMatcher(request.stop)
        self._eos = frozenset(() if request.ignore_eos else eos_ids)
        self._stop_ids = frozenset(request.sampling.stop_token_ids)
        self._min_tokens = request.sampling.min_tokens  # nothing but the token budget ends it before these
        # ... nor anything but its grammar's end: the head lets EOS through under min_tokens only when the
        # grammar allows nothing else (logits_processors.process_logits), and the grammar has then ended
        self._grammar_ends = request.grammar is not None
        self._last_is_stop_token = False
        self._tokenizer = tokenizer
        self._stream = stream
        decode = tokenizer is not None and (stream or bool(request.stop))
        self._detok = IncrementalDetokenizer(tokenizer) if decode and tokenizer is not None else None
        self._final: str | None = None  # the final text, once known
        self._size = 0  # characters of incremental text so far
        self._sent = 0  # how many of them the deltas returned so far add up to
        self._pending = ""  # the incremental text not sent yet: held back (at most a stop's length) + the newest

    def append(self, token: int) -> tuple[str, str | None]:
        """Adds the next generated token; returns (the text a stream may send now, the finish reason or
        None while the output goes on)."""
        if self.finish_reason is not None:
            raise ValueError(f"the output already finished ({self.finish_reason})")
        self.token_ids.append(token)
        self.finish_reason = self._check(token)
        if self.finish_reason is not None:
            return self._send_final(self.final_text or ""), self.finish_reason
        if not self._stream or self._detok is None:
            return "", None
        # the pending text holds no stop string (the check would have finished the output); send all
        # of it but what could still begin one. Work: the pending text's length, never the output's
        release = len(self._pending) - self._matcher.held
        if release <= 0:
            return "", None
        delta, self._pending = self._pending[:release], self._pending[release:]
        self._sent += release
        return delta, None

    @property
    def final_text(self) -> str | None:
        """The output's text (so far, before it finishes); None without a tokenizer."""
        if self._final is not None:
            return self._final
        if self._tokenizer is None:
            return None
        ends = self.finish_reason == FINISH_EOS or self._last_is_stop_token
        ids = self.token_ids[:-1] if ends else self.token_ids
        text = self._tokenizer.decode(ids)
        if self.finish_reason is not None:
            self._final = text  # decoded once: the result and the last delta both read it
        return text

    def _check(self, token: int) -> str | None:
        early = len(self.token_ids) <= self._min_tokens  # (the head masks EOS and stop ids until then)
        if (not early or self._grammar_ends) and token in self._eos:  # not decoded: EOS is no part of the text
            return FINISH_EOS
        if not early and token in self._stop_ids:  # "stop", as a stop string; the token, as EOS, is not text
            self._last_is_stop_token = True
            return FINISH_STOP
        if self._detok is not None:
            new = self._detok.push([token])
            before = self._size
            self._size += len(new)
            if self._stream:
                self._pending += new
            if self._stops and new:
                hit = self._matcher.feed(new)  # only the newest text can complete a stop string
                if hit != NO_STOP and len(self.token_ids) >= self._min_tokens:
                    assert self._tokenizer is not None  # _detok exists only with one
                    # the output text is the whole output decoded, cut at the stop; the incremental
                    # text is the fallback should the whole decode not show the stop
                    text = self._tokenizer.decode(self.token_ids)
                    # (under min_tokens a stop in the text before the minimum did not count: cut at this one)
                    cut = -1 if self._min_tokens else first_stop(text, self._stops)
                    self._final = text[:cut] if cut >= 0 else self._detok.text[: before + hit]
                    return FINISH_STOP
        if len(self.token_ids) >= self._max_new_tokens:
            return FINISH_LENGTH
        return None

    def _send_final(self, final: str) -> str:
        """The part of the final text not sent yet (once per request, so its O(output) compare is fine).
        Nothing when it does not extend what was sent: a delta cannot be taken back (only a whole decode
        that disagrees with the incremental one does that)."""
        if len(final) <= self._sent:
            return ""
        if self._sent:
            assert self._detok is not None  # something was sent: it came from the incremental text
            if not final.startswith(self._detok.text[: self._sent]):
                return ""
        delta, self._sent = final[self._sent :], len(final)
        return delta
