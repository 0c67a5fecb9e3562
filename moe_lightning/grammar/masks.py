"""A step's token masks: one parallel fill on the host, one copy, one masking call on the logits' device."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from moe_lightning.grammar.compiler import GrammarState, GrammarStateError

if TYPE_CHECKING:
    import llguidance
    import torch

_executor: llguidance.LLExecutor | None = None
_executor_threads: int | None = None
_executor_lock = threading.Lock()
_bit_values: dict[torch.device, torch.Tensor] = {}


def set_mask_threads(threads: int | None) -> None:
    """Threads of the parallel fill (default: every CPU this process may run on). The fill runs while
    the step waits for it, so it can use the head's cores; set before the first step."""
    global _executor, _executor_threads
    if threads is not None and threads < 1:
        raise ValueError(f"mask threads must be >= 1, got {threads}")
    with _executor_lock:
        _executor, _executor_threads = None, threads


def mask_executor() -> llguidance.LLExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            import llguidance

            # llguidance's own default is 80 % of the CPUs, which is one thread on a 2-core machine
            threads = _executor_threads or len(os.sched_getaffinity(0))
            _executor = llguidance.LLExecutor(num_threads=threads)
        return _executor


def fill_bitmask(states: Sequence[GrammarState], bitmask: torch.Tensor) -> None:
    """Row i of `bitmask` (int32, (>= len(states), words), host, contiguous) gets states[i]'s allowed tokens."""
    if not states:
        return
    words = bitmask.shape[1]
    mask_executor().unsafe_compute_mask_ptr(
        [(s._matcher, i) for i, s in enumerate(states)], bitmask.data_ptr(), words * 4, bitmask.shape[0]
    )


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """logits[rows[i], t] = -inf where bit t of bitmask[i] is 0, in place; rows None: every row.

    bitmask: int32 (b, ceil(V / 32)) on the logits' device, bit t % 32 of word t // 32 for token t.
    Plain torch ops (no compile step, any device, any float dtype): the int32 words are read as their
    little-endian bytes (x86 and CUDA), byte k holding tokens 8k..8k+7, against the 8 bit values."""
    import torch

    b, words = bitmask.shape
    vocab = logits.shape[1]
    bits = _bit_values.get(logits.device)
    if bits is None:
        bits = _bit_values[logits.device] = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8).to(
            logits.device
        )
    disallowed = ((bitmask.view(torch.uint8).view(b, words * 4, 1) & bits) == 0).view(b, words * 32)[:, :vocab]
    if rows is None:
        logits.masked_fill_(disallowed, float("-inf"))
    else:
        # index_select / index_copy_ touch only the masked rows: the others stay bit-identical
        sub = logits.index_select(0, rows)
        sub.masked_fill_(disallowed, float("-inf"))
        logits.index_copy_(0, rows, sub)


def apply_grammar_masks(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
    """Masks a step's (B, V) logits in place: row b keeps only the tokens states[b] allows (-inf
    elsewhere, extra ids past the tokenizer included); rows with None are untouched. One parallel fill
    of the host bitmask for all the rows with a state, one (pinned, asynchronous) copy to the logits'
    device and one masking call there."""
    import torch

    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} states")
    rows = [b for b, s in enumerate(states) if s is not None]
    if not rows:
        return
    active: list[GrammarState] = [states[b] for b in rows]  # type: ignore[misc]
    vocabulary = active[0].grammar.vocabulary
    if logits.shape[1] != vocabulary.vocab_size:
        raise ValueError(f"logits have {logits.shape[1]} columns, the grammar vocabulary {vocabulary.vocab_size}")
    if any(s.grammar.vocabulary is not vocabulary for s in active):
        raise ValueError("the states of one batch must share one grammar vocabulary")
    on_host = logits.device.type == "cpu"
    # pinned memory (from torch's caching host allocator, which keeps a block until its copy is done)
    # makes the copy asynchronous: the fill of the next step cannot overwrite a block still in flight
    bitmask = torch.empty((len(active), vocabulary.bitmask_words), dtype=torch.int32, pin_memory=not on_host)
    fill_bitmask(active, bitmask)
    index = None
    if len(rows) != len(states):
        index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    apply_token_bitmask(logits, bitmask if on_host else bitmask.to(logits.device, non_blocking=True), index)


def accept_tokens(states: Sequence[GrammarState | None], tokens: Sequence[int]) -> None:
    """states[b].accept(tokens[b]) for every row with a state, the library's parallel consume for the
    batch. Raises GrammarStateError for the first row that rejects its token (after the others are
    recorded)."""
    if len(states) != len(tokens):
        raise ValueError(f"{len(states)} states but {len(tokens)} tokens")
    to_library: list[tuple[GrammarState, int]] = []
    skipped: list[tuple[GrammarState, int]] = []  # failed states ending on a stop token
    for state, token in zip(states, tokens, strict=True):
        if state is not None:
            (to_library if state._consumes(int(token)) else skipped).append((state, int(token)))
    results = mask_executor().consume_token_par([(s._matcher, t) for s, t in to_library]) if to_library else []
    failed: Exception | None = None
    for (state, token), ok in [*zip(to_library, results, strict=True), *((row, True) for row in skipped)]:
        try:
            state._record(token, ok)
        except GrammarStateError as exc:
            failed = failed or exc
    if failed is not None:
        raise failed
