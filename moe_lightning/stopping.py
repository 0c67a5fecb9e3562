"""When a sequence is done: EOS, a stop string in the decoded text, or its token budget."""

from __future__ import annotations

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

    def check(self, token_ids: list[int]) -> str | None:
        """token_ids: the generated ids so far (the newest last); returns a finish reason or None."""
        if token_ids[-1] in self.eos_ids:
            return FINISH_EOS
        if self.request.stop and self.tokenizer is not None:
            # Decoding the whole output each step keeps multi-token and multi-byte stops exact.
            text = self.tokenizer.decode(token_ids)
            cut = min((i for i in (text.find(s) for s in self.request.stop) if i >= 0), default=-1)
            if cut >= 0:
                self.text = text[:cut]
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
