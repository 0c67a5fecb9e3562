"""How a model's layers share the blocks of a paged KV cache (docs/kv-cache.md, "Sliding-window layers").

A layer that attends within a sliding window reads only the window's last tokens, so the blocks behind
its window can go back to the pool as a sequence grows, while a full-attention layer keeps every block.
As vLLM's hybrid allocator does, the layers are cut into groups of one size, each group attending within
one window (or the whole context); a physical block holds one group's layers for BS tokens, each group
has a block table per sequence, and all groups draw from one pool. A model whose layers all attend alike
is one group: a block holds every layer, as it did before there were windows.

GPT-OSS alternates a 128-token window with the whole context: two groups of L/2 layers, and a sequence
of n tokens holds ceil(n / BS) full-layer blocks and about (128 + BS) / BS sliding ones, half the bytes
of n tokens in every layer once n is well past the window.

Shared by the caches (kv_cache.py, which free the blocks) and the orchestrator's batcher (which counts
them at admission): both compute a sequence's blocks with `blocks_held`, so they agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_lightning.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class KVLayout:
    block_size: int = 1
    windows: tuple[int | None, ...] = (None,)  # (G,) each group's window, None for the whole context
    layer_group: tuple[int, ...] = ()  # (L,) the group of each layer
    layer_slot: tuple[int, ...] = ()  # (L,) its index in its group's layers: the cache storage's first dim
    group_layers: int = 0  # layers a block holds (L / G)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @classmethod
    def of(cls, spec: ModelSpec, block_size: int) -> KVLayout:
        windows = [spec.window_of(i) for i in range(spec.num_layers)]
        by_window: dict[int | None, list[int]] = {}
        for layer, w in enumerate(windows):
            by_window.setdefault(w, []).append(layer)
        size = math.gcd(*(len(layers) for layers in by_window.values()))  # equal groups: one block shape
        group_windows: list[int | None] = []
        layer_group = [0] * spec.num_layers
        layer_slot = [0] * spec.num_layers
        # the whole-context group first: group 0's table is the one code that knows no groups reads
        # (AttentionMetadata.block_tables), and it then never holds a freed (-1) entry
        for w, layers in sorted(by_window.items(), key=lambda item: item[0] is not None):
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start : start + size]):
                    layer_group[layer], layer_slot[layer] = len(group_windows), slot
                group_windows.append(w)
        return cls(block_size, tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def first_live_block(self, group: int, start: int) -> int:
        """The first block of `group` a step whose new tokens begin at position `start` reads: the
        blocks before it hold only keys no query from `start` on can see (a query at p sees p - W < k)."""
        w = self.windows[group]
        return 0 if w is None else max(0, start - w + 1) // self.block_size

    def blocks_held(self, start: int, end: int) -> int:
        """Blocks a sequence holds, in all groups, while a step writes its tokens start..end-1 (the
        cache frees each sliding group's blocks behind the window before it takes the step's)."""
        n = -(-end // self.block_size)
        return sum(n - self.first_live_block(g, start) for g in range(self.num_groups))

    def blocks_for(self, tokens: int) -> int:
        """Blocks `tokens` written in one step take: every group's, nothing freed yet."""
        return self.blocks_held(0, tokens)

    def held_share(self, context: float) -> float:
        """The share of a `context`-token sequence's blocks in every group that it holds once its
        windows freed theirs (1 without windows): what the planner sizes a batch by."""
        c = max(context, 1.0)
        return sum(1.0 if w is None else min(c, w + self.block_size) / c for w in self.windows) / self.num_groups

    def tokens_in(self, blocks: int) -> int:
        """Tokens `blocks` hold for certain (in every group, as if no window freed any)."""
        return blocks // self.num_groups * self.block_size
