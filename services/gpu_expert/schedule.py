"""The order in which gpu_expert sends micro-batches to attention and takes their results back.

CGOPipe (docs/design.md) runs per micro-batch, not per layer: receive (l, m) -> post-attention
(l, m) -> pre-attention (l + 1, m) -> send (l + 1, m). Attention of one micro-batch then always
overlaps device work on another, across layer boundaries too (no barrier per layer). Hand-offs
are numbered i = l * n_ub + m; both channels are FIFO, so sends and receives each go in that
order, and at most `window` of them are outstanding (moe_lightning/handoff.py: flow control).
The `*_steps` orders add where each layer takes its experts and issues the next layer's pages, so
the runner's step is this order, op by op.

Grouped experts (`expert_groups`, docs/cgopipe-and-benchmarks.md "Experts once per group"): the
micro-batches are split into that many groups and a layer's FFN runs once per group, over the rows of
all its micro-batches, so the device reads each touched expert once a group rather than once a
micro-batch. A receive then does only the per-token part of post-attention (COLLECT); the group's
FFN follows its last micro-batch's receive, and layer l + 1 of a micro-batch is sent only after
its group's FFN of layer l. With two groups they ping-pong: host attention of one overlaps the
device's FFN of the other (MoE-Lens' VSLPipe).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

SEND, RECEIVE = "send", "receive"
COLLECT = "collect"  # hand-off in + the per-token part of post-attention; the FFN waits for the group
GROUP_FFN = "group_ffn"  # a group's FFN (router, experts, residual) over its micro-batches at once


@dataclass(frozen=True, slots=True)
class Op:
    kind: str  # SEND (pre-attention + hand-off out), RECEIVE (hand-off in + post-attention), or below
    layer: int
    micro_batch: int  # PREFETCH: the page of `layer`'s streamed experts; GROUP_FFN: the group's first
    count: int = 1  # GROUP_FFN: the group's micro-batches, from `micro_batch` on


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


def group_bounds(num_micro_batches: int, groups: int) -> list[tuple[int, int]]:
    """(first micro-batch, count) of each group: `groups` contiguous runs as equal as they can be
    (the first ones one longer); 0 or more groups than micro-batches: one group each."""
    if groups <= 0 or groups >= num_micro_batches:
        return [(m, 1) for m in range(num_micro_batches)]
    size, extra = divmod(num_micro_batches, groups)
    bounds, first = [], 0
    for g in range(groups):
        count = size + (g < extra)
        bounds.append((first, count))
        first += count
    return bounds


Groups = list[tuple[int, int]]  # (first micro-batch, count) of each group, in order, covering them all


def capped_groups(tokens: list[int], groups: int, cap: int) -> Groups | None:
    """The groups of a step whose micro-batches carry `tokens` tokens each: group_bounds, each group
    then split where its tokens would pass `cap` (the largest micro-batch gpu_expert's memory reserve
    holds activations for: a group's FFN works on all its rows at once). None: once per micro-batch."""
    bounds: Groups = []
    for first, count in group_bounds(len(tokens), groups):
        start, held = first, 0
        for m in range(first, first + count):
            if m > start and held + tokens[m] > cap:
                bounds.append((start, m - start))
                start, held = m, 0
            held += tokens[m]
        bounds.append((start, first + count - start))
    return bounds if len(bounds) < len(tokens) else None


def grouped_order(num_layers: int, num_micro_batches: int, window: int, bounds: Groups) -> Iterator[Op]:
    """CGOPipe with a layer's FFN once per group: sends run ahead of receives by at most `window`
    hand-offs, as in cgopipe_order, and a send of (l, m) with l > 0 waits for the FFN of (l - 1, m's
    group). It cannot deadlock: when every send so far was received, the next one's group at l - 1
    was received whole, so its FFN ran."""
    if num_layers < 1 or num_micro_batches < 1 or window < 1:
        raise ValueError("layers, micro-batches and the window must be positive")
    if sum(count for _, count in bounds) != num_micro_batches:
        raise ValueError(f"the groups {bounds} do not cover {num_micro_batches} micro-batches")
    group_of = [g for g, (_, count) in enumerate(bounds) for _ in range(count)]
    total = num_layers * num_micro_batches
    sent = received = 0
    done: set[tuple[int, int]] = set()  # (layer, group) whose FFN ran
    while received < total:
        while sent < total and sent < received + window:
            layer, m = divmod(sent, num_micro_batches)
            if layer > 0 and (layer - 1, group_of[m]) not in done:
                break
            yield Op(SEND, layer, m)
            sent += 1
        layer, m = divmod(received, num_micro_batches)
        yield Op(COLLECT, layer, m)
        received += 1
        first, count = bounds[group_of[m]]
        if m == first + count - 1:
            yield Op(GROUP_FFN, layer, first, count)
            done.add((layer, group_of[m]))


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
ATTEND_COLLECT = "attend_collect"  # ATTEND up to the FFN, which waits for the group (GROUP_FFN)


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


def grouped_steps(num_layers: int, num_micro_batches: int, window: int, bounds: Groups) -> Iterator[Op]:
    """grouped_order with the pages: as cgopipe_steps, a layer takes its experts at its first receive
    (the FFN that reads them comes later) and issues a page of the next layer after each receive; it
    ends with its last group's FFN."""
    for op in grouped_order(num_layers, num_micro_batches, window, bounds):
        if op.kind == SEND:
            yield op
        elif op.kind == COLLECT:
            if op.micro_batch == 0:
                yield Op(BEGIN, op.layer, 0)
                yield Op(PREFETCH, op.layer + 1, 0)
            yield op
            yield Op(PREFETCH, op.layer + 1, op.micro_batch + 1)
        else:
            yield op
            if op.micro_batch + op.count == num_micro_batches:
                yield Op(END, op.layer, op.micro_batch)


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


def local_grouped_steps(num_layers: int, num_micro_batches: int, bounds: Groups) -> Iterator[Op]:
    """Attention on the device with a layer's FFN once per group: each micro-batch of a group attends
    in place, then the group's FFN runs (nothing on the host to ping-pong with; the pages of l + 1
    still interleave)."""
    for layer in range(num_layers):
        for first, count in bounds:
            for m in range(first, first + count):
                if m == 0:
                    yield Op(BEGIN, layer, 0)
                    yield Op(PREFETCH, layer + 1, 0)
                yield Op(ATTEND_COLLECT, layer, m)
                yield Op(PREFETCH, layer + 1, m + 1)
            yield Op(GROUP_FFN, layer, first, count)
        yield Op(END, layer, num_micro_batches - 1)
