"""Structured output on the orchestrator's side (docs/structured-outputs.md): each such sequence's grammar
state lives with its output here, where every kept token arrives, so a preempted and re-prefilled sequence
keeps its state untouched. Before a step runs, the masks of every sequence whose sample the step keeps
are filled in one batched call and travel with the step; the head applies them all in one call on the
device the logits are on (moe_lightning/logits_processors.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_lightning.request import GenerationRequest, InvalidRequestError
from moe_lightning.spec import ModelSpec
from moe_lightning.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from moe_lightning.grammar import CompiledGrammar, GrammarCompiler, GrammarSpec, GrammarState
    from orchestrator.batcher import NewToken, ScheduledStep

NEEDS_TOKENIZER = (
    "structured output needs the model's tokenizer.json (the grammar works on text), and this model has none"
)


class Grammars:
    """The server's grammar compiler (built at the first structured request: the library's import and the
    vocabulary's preparation cost nothing to servers that never see one) and the per-step work."""

    def __init__(self, spec: ModelSpec, tokenizer: TextTokenizer | None) -> None:
        self.spec, self.tokenizer = spec, tokenizer
        self._compiler: GrammarCompiler | None = None

    def compiler(self) -> GrammarCompiler:
        if self.tokenizer is None:
            raise InvalidRequestError(NEEDS_TOKENIZER)
        if self._compiler is None:
            from moe_lightning.grammar import GrammarCompiler, GrammarVocabulary

            vocabulary = GrammarVocabulary(self.tokenizer, self.spec.vocab_size, self.spec.eos_token_ids)
            self._compiler = GrammarCompiler(vocabulary)
        return self._compiler

    def check(self, spec: GrammarSpec) -> None:
        """A grammar the library cannot compile, or that cannot start (its first mask and first tokens are
        computed: moe_lightning/grammar/limits.py), is the client's error. Runs on the API's threads, at
        admission; cached: its requests compile it once."""
        self._compile(spec)

    def start(self, request: GenerationRequest) -> GrammarState | None:
        if request.grammar is None:
            return None
        # a cache hit, but for a grammar evicted since its admission: compiled again, as admitted
        return self._compile(request.grammar).new_state()

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        from moe_lightning.grammar import GrammarError

        try:
            return self.compiler().compile(spec)
        except GrammarError as exc:
            raise InvalidRequestError(f"the grammar cannot be used: {exc}") from None

    def attach_masks(self, step: ScheduledStep) -> None:
        """Sets the token mask of each work whose sequence has a grammar and whose sample the step keeps
        (a decode, or the chunk that reaches the end of its tokens)."""
        seqs = {s.seq_id: s for s in step.sequences if s.grammar is not None}
        if not seqs:
            return
        import torch

        from moe_lightning.grammar import fill_bitmask
        from moe_lightning.logits_processors import mask_words

        works = [
            w
            for mb in step.plan.micro_batches
            for w in mb
            if w.seq_id in seqs and w.start + len(w.token_ids) == seqs[w.seq_id].length
        ]
        bitmask = torch.zeros((len(works), mask_words(self.spec.vocab_size)), dtype=torch.int32)
        fill_bitmask([seqs[w.seq_id].grammar for w in works], bitmask)  # type: ignore[misc]  # one batched call
        for w, row in zip(works, bitmask.numpy(), strict=True):
            w.token_mask = row.astype("<i4").tobytes()

    @staticmethod
    def advance(tokens: list[NewToken]) -> None:
        """Each kept token moves its sequence's grammar on (a finished one's is dropped)."""
        for new in tokens:
            grammar = new.seq.grammar
            if grammar is None:
                continue
            if new.finish_reason is None:
                grammar.accept(new.token_id)
            else:
                new.seq.grammar = None
