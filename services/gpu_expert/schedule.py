"""The order in which gpu_expert sends micro-batches to attention and takes their results back.

CGOPipe (docs/design.md) runs per micro-batch, not per layer: receive (l, m) -> post-attention
(l, m) -> pre-attention (l + 1, m) -> send (l + 1, m). Attention of one micro-batch then always
overlaps device work on another, across layer boundaries too (no barrier per layer). Hand-offs
are numbered i = l * n_ub + m; both channels are FIFO, so sends and receives each go in that
order, and at most `window` of them are outstanding (moe_lightning/handoff.py: flow control).
The `*_steps` orders add where each layer takes its experts and issues the next layer's pages, so
the runner's step is this order, op by op.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

SEND, RECEIVE = "send", "receive"


@dataclass(frozen=True, slots=True)
class Op:
    kind: str  # SEND (pre-attention + hand-off out), RECEIVE (hand-off in + post-attention), or below
    layer: int
    micro_batch: int  # PREFETCH: the page of `layer`'s streamed experts


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


# ---- a step's whole order: the stages above with the expert pages in it -------------------------
# The runner walks one of these op by op and does nothing else: where a layer takes its experts and
# when the pages of the next layer are issued is part of the order, not a branch in the runner.
BEGIN, PREFETCH, END = "begin_layer", "prefetch", "end_layer"  # a layer's experts; page m of a layer
ATTEND = "attend"  # pre-attention, attention over the device KV cache and post-attention, in place


def _paged(op: Op, num_micro_batches: int, begin: bool) -> Iterator[Op]:
    """A post-attention op with the pages around it: at micro-batch 0 (with `begin`) layer l takes
    its experts and page 0 of l + 1 is issued; page m + 1 after micro-batch m; l ends with its last."""
    layer, m = op.layer, op.micro_batch
    if begin and m == 0:
        yield Op(BEGIN, layer, 0)
        yield Op(PREFETCH, layer + 1, 0)
    yield op
    yield Op(PREFETCH, layer + 1, m + 1)
    if m == num_micro_batches - 1:
        yield Op(END, layer, m)


def cgopipe_steps(num_layers: int, num_micro_batches: int, window: int) -> Iterator[Op]:
    """CGOPipe with attention in cpu_attention: a layer takes its experts at its first post-attention,
    so the sends ahead of it overlap the pages still arriving."""
    for op in cgopipe_order(num_layers, num_micro_batches, window):
        if op.kind == SEND:
            yield op
        else:
            yield from _paged(op, num_micro_batches, begin=True)


def sequential_steps(num_layers: int, num_micro_batches: int) -> Iterator[Op]:
    """The overlap-off baseline: a layer's experts are copied before its first send (its pager has no
    look-ahead, so the page ops after each micro-batch issue nothing)."""
    for op in sequential_order(num_layers, num_micro_batches):
        if op.kind == RECEIVE:
            yield from _paged(op, num_micro_batches, begin=False)
            continue
        if op.micro_batch == 0:
            yield Op(BEGIN, op.layer, 0)
        yield op


def local_steps(num_layers: int, num_micro_batches: int) -> Iterator[Op]:
    """Attention on the device: no hand-offs, each micro-batch attends in place; the pages of layer
    l + 1 still interleave with the micro-batches of layer l."""
    for layer in range(num_layers):
        for m in range(num_micro_batches):
            yield from _paged(Op(ATTEND, layer, m), num_micro_batches, begin=True)
