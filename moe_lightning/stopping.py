"""When a sequence is done: EOS, a stop string in the decoded text, or its token budget."""

from __future__ import annotations

from moe_lightning.detokenize import IncrementalDetokenizer, first_stop
from moe_lightning.request import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, GenerationRequest
from moe_lightning.tokenizer import TextTokenizer


class StopChecker:
    def __init__(self, request: GenerationRequest, eos_ids: tuple[int, ...], tokenizer: TextTokenizer | None) -> None:
        if request.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer to decode the output")
        self.request = request
        self.eos_ids = () if request.ignore_eos else eos_ids
        self.tokenizer = tokenizer
        self.text: str | None = None
        self._detok = IncrementalDetokenizer(tokenizer) if request.stop and tokenizer is not None else None
        self._longest = max((len(s) for s in request.stop), default=0)

    def check(self, token_ids: list[int]) -> str | None:
        """token_ids: the generated ids so far (the newest last); returns a finish reason or None."""
        if token_ids[-1] in self.eos_ids:
            return FINISH_EOS
        if self._detok is not None and self.tokenizer is not None:
            # only the newest text can complete a stop string: search from one stop's length back
            searched = len(self._detok.text)
            self._detok.push(token_ids[len(self._detok.ids) :])
            hit = first_stop(self._detok.text, self.request.stop, max(0, searched - self._longest + 1))
            if hit >= 0:
                # once per request: the output text is the whole output decoded, cut at the stop
                text = self.tokenizer.decode(token_ids)
                cut = first_stop(text, self.request.stop)
                self.text = text[:cut] if cut >= 0 else self._detok.text[:hit]
                return FINISH_STOP
        if len(token_ids) >= self.request.max_new_tokens:
            return FINISH_LENGTH
        return None

    def final_text(self, token_ids: list[int]) -> str | None:
        if self.text is not None:
            return self.text
        if self.tokenizer is None:
            return None
        ids = token_ids[:-1] if token_ids and token_ids[-1] in self.eos_ids else token_ids
        return self.tokenizer.decode(ids)
