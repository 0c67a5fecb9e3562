"""The order in which gpu_expert sends micro-batches to attention and takes their results back.

CGOPipe (docs/design.md) runs per micro-batch, not per layer: receive (l, m) -> post-attention
(l, m) -> pre-attention (l + 1, m) -> send (l + 1, m). Attention of one micro-batch then always
overlaps device work on another, across layer boundaries too (no barrier per layer). Hand-offs
are numbered i = l * n_ub + m; both channels are FIFO, so sends and receives each go in that
order, and at most `window` of them are outstanding (moe_lightning/handoff.py: flow control).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

SEND, RECEIVE = "send", "receive"


@dataclass(frozen=True, slots=True)
class Op:
    kind: str  # SEND (pre-attention + hand-off out) or RECEIVE (hand-off in + post-attention)
    layer: int
    micro_batch: int


def cgopipe_order(num_layers: int, num_micro_batches: int, window: int) -> Iterator[Op]:
    """Sends run ahead of receives by at most `window` hand-offs. A send of (l, m) with l > 0 needs
    the receive of (l - 1, m), n_ub hand-offs earlier, so a window above n_ub cannot be used."""
    if num_layers < 1 or num_micro_batches < 1 or window < 1:
        raise ValueError("layers, micro-batches and the window must be positive")
    window = min(window, num_micro_batches)
    total = num_layers * num_micro_batches
    sent = received = 0
    while received < total:
        while sent < total and sent < received + window:
            yield Op(SEND, *divmod(sent, num_micro_batches))
            sent += 1
        yield Op(RECEIVE, *divmod(received, num_micro_batches))
        received += 1


def sequential_order(num_layers: int, num_micro_batches: int) -> Iterator[Op]:
    """The overlap-off baseline (FlexGen/DeepSpeed style): each micro-batch waits for its own
    attention before the next one starts."""
    for layer in range(num_layers):
        for m in range(num_micro_batches):
            yield Op(SEND, layer, m)
            yield Op(RECEIVE, layer, m)
