"""Structured output on the orchestrator's side (docs/structured-outputs.md): each such sequence's grammar
state lives with its output here, where every kept token arrives, so a preempted and re-prefilled sequence
keeps its state untouched. Before a step runs, the masks of every sequence whose sample the step keeps
are filled in one batched call and travel with the step; the head applies them all in one call on the
device the logits are on (moe_lightning/logits_processors.py). With the overlap on (the default: vLLM's
design, issue 54) the step is sent first, its rows flagged `mask_follows`, and the masks are filled while
its layers run and sent after it (gpu_expert's head waits for them only when it samples): no step, plain
rows included, waits for the grammars any more."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from moe_lightning.request import GenerationRequest, InvalidRequestError
from moe_lightning.service.errors import ServiceError
from moe_lightning.spec import ModelSpec
from moe_lightning.tokenizer import TextTokenizer

if TYPE_CHECKING:
    import torch

    from moe_lightning.grammar import CompiledGrammar, GrammarCompiler, GrammarSpec, GrammarState
    from moe_lightning.step_protocol import SequenceWork, StepOutput
    from orchestrator.backend import Backend
    from orchestrator.batcher import NewToken, ScheduledStep, Sequence

# a sequence whose grammar raised, and the error it ends with (alone: issue 54)
Faults = list[tuple["Sequence", BaseException]]
Masks = dict[int, bytes]  # seq id -> its token mask, for the rows of a step already sent

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

    def run_step(
        self, step: ScheduledStep, backend: Backend, overlap: bool, end: Callable[[Faults], None]
    ) -> StepOutput:
        """Runs the step on the backend with its masks: filled while it runs (`overlap`, when it has rows
        to mask), else before it is sent. `end` ends the sequences whose mask could not be filled, alone."""
        if overlap and (following := self._kept(step)[1]):
            for w in following:
                w.mask_follows = True
            return backend.step(step.plan, lambda: self._fill_following(step, following, end))
        end(self.attach_masks(step))  # those end now: their works run without a mask
        return backend.step(step.plan)

    def _fill_following(self, step: ScheduledStep, works: list[SequenceWork], end: Callable[[Faults], None]) -> Masks:
        """The masks of a step already sent (never raises: a fault ends the rows it concerns alone, and
        gpu_expert samples them unmasked, their tokens unused)."""
        try:
            end(self.attach_masks(step))
        except Exception as exc:
            error = ServiceError(f"internal error filling a grammar's token mask: {exc}; the request was not completed")
            end([(s, error) for s in step.sequences if s.grammar is not None])
            return {}
        return {w.seq_id: w.token_mask for w in works if w.token_mask is not None}

    def _kept(self, step: ScheduledStep) -> tuple[dict[int, Sequence], list[SequenceWork]]:
        """The step's sequences that have a grammar, and their works whose sample the step keeps (a
        decode, or the chunk that reaches the end of its tokens)."""
        seqs = {s.seq_id: s for s in step.sequences if s.grammar is not None}
        if not seqs:
            return seqs, []
        works = [
            w
            for mb in step.plan.micro_batches
            for w in mb
            if w.seq_id in seqs and w.start + len(w.token_ids) == seqs[w.seq_id].length
        ]
        return seqs, works

    def attach_masks(self, step: ScheduledStep) -> Faults:
        """Sets the token mask of each work whose sequence has a grammar and whose sample the step keeps.
        Returns the sequences whose mask could not be filled: they end alone, the step runs on for the
        others (their works go without a mask and their tokens are dropped)."""
        seqs, works = self._kept(step)
        if not works:
            return []
        import torch

        from moe_lightning.grammar import fill_bitmask
        from moe_lightning.logits_processors import mask_words

        bitmask = torch.zeros((len(works), mask_words(self.spec.vocab_size)), dtype=torch.int32)
        states: list[GrammarState] = [seqs[w.seq_id].grammar for w in works]  # type: ignore[misc]
        failed: dict[int, Exception] = {}
        try:
            fill_bitmask(states, bitmask)  # one batched call
        except Exception:  # which row failed is unknown: each alone, so that only the faulty ones end
            failed = _fill_rows(states, bitmask)
        faults: Faults = []
        for i, (w, row) in enumerate(zip(works, bitmask.numpy(), strict=True)):
            if i in failed:
                error = f"the request's grammar could not compute its next token mask: {failed[i]}"
                faults.append((seqs[w.seq_id], InvalidRequestError(error)))
            else:
                w.token_mask = row.astype("<i4").tobytes()
        return faults

    @staticmethod
    def advance(tokens: list[NewToken]) -> Faults:
        """Each kept token moves its sequence's grammar on (a finished one's is dropped). Returns the
        sequences whose grammar refused its token (a parser or lexer limit reached mid-output): they
        end alone, the others keep their tokens."""
        faults: Faults = []
        for new in tokens:
            grammar = new.seq.grammar
            if grammar is None:
                continue
            if new.finish_reason is not None:
                new.seq.grammar = None
                continue
            try:
                grammar.accept(new.token_id)
            except Exception as exc:
                from moe_lightning.grammar.limits import library_words

                error = (
                    f"the request's grammar failed after {grammar.num_tokens} output tokens "
                    f"({library_words(str(exc))}); the grammar "
                    "library's limits were reached: simplify its patterns or choices"
                )
                faults.append((new.seq, InvalidRequestError(error)))
        return faults


def _fill_rows(states: list[GrammarState], bitmask: torch.Tensor) -> dict[int, Exception]:
    """Fills each row of `bitmask` on its own; returns the rows that raised, by index."""
    from moe_lightning.grammar import fill_bitmask

    failed: dict[int, Exception] = {}
    for i, state in enumerate(states):
        try:
            fill_bitmask([state], bitmask[i : i + 1])
        except Exception as exc:
            failed[i] = exc
    return failed
