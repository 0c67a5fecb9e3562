"""Paged KV cache: fixed-size blocks, a free list, and a block table per sequence.

It stores K/V in one of kv_format's formats: a float dtype, or int8 values with an fp32 scale per token
per KV head (docs/kv-cache.md).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable

import torch

from moe_lightning import kv_format
from moe_lightning.kv_layout import KVLayout
from moe_lightning.spec import ModelSpec
from moe_lightning.stages.attention import AttentionMetadata, Int8KV, KVCache

KVStorage = tuple[KVCache, KVCache]  # (k, v) of a block's layers: (Lg, NB, BS, K, Hd) tensors, or Int8KV
# a view of `shape` elements of `dtype` at a byte offset into some memory, as Segment.tensor makes
ViewFn = Callable[[int, torch.dtype, tuple[int, ...]], torch.Tensor]
SCALE_ALIGN = 64  # an int8 cache's scales start on a cache line after the values


def format_name(fmt: str | torch.dtype) -> str:
    """The kv_format name of `fmt`: a format name, or a float torch dtype (the device cache passes its
    weights' dtype)."""
    name = fmt if isinstance(fmt, str) else str(fmt).removeprefix("torch.")
    return kv_format.check_format(name)


class KVCacheFullError(RuntimeError):
    """Not enough free blocks for the tokens asked for."""


class BlockAllocator:
    def __init__(self, num_blocks: int, shuffle_seed: int | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        order = list(range(num_blocks))
        if shuffle_seed is not None:  # tests use this to prove block order does not matter
            random.Random(shuffle_seed).shuffle(order)
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(order)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCacheFullError(f"KV cache full: need {n} blocks, {len(self._free)} of {self.num_blocks} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


class PagedKVCache:
    """K and V storage: (Lg, NB, BS, K, Hd) each (for int8, an Int8KV: those values and (Lg, NB, BS, K)
    scales), plus per-sequence bookkeeping. Lg is the layers a block holds: all of them, unless some
    attend within a sliding window, whose layers then take blocks of their own that go back to the pool
    behind the window (kv_layout.py). `layer(i)` is layer i's K and V."""

    def __init__(
        self,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "cpu",
        shuffle_seed: int | None = None,
        storage: KVStorage | None = None,
    ) -> None:
        """`dtype`: a float dtype or a kv_format name ("int8"). `storage`, when given, is the (k, v)
        memory to use, e.g. views into shared memory (`storage_in`)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.format = format_name(dtype)
        self.layout = KVLayout.of(spec, block_size)
        shape = self.storage_shape(spec, num_blocks, block_size)
        if storage is None and kv_format.is_quantized(self.format):
            storage = self.storage_in(_zeros(device), spec, num_blocks, block_size, self.format)
        elif storage is None:
            k = torch.zeros(shape, dtype=getattr(torch, self.format), device=device)
            storage = (k, k if spec.kv_tensors == 1 else torch.zeros_like(k))
        elif tuple(storage[0].shape) != shape or tuple(storage[1].shape) != shape:
            raise ValueError(f"KV storage must have shape {shape}")
        elif isinstance(storage[0], Int8KV) != kv_format.is_quantized(self.format):
            raise ValueError(f"KV storage does not hold the {self.format} format")
        self.k, self.v = storage
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks, shuffle_seed)
        # group 0's block table of each sequence, then the other groups' (-1: freed behind the window)
        self.tables: dict[int, list[int]] = {}
        self.group_tables: list[dict[int, list[int]]] = [{} for _ in range(self.layout.num_groups - 1)]
        self.lengths: dict[int, int] = {}
        self._live_from: dict[tuple[int, int], int] = {}  # (group, seq) -> its first block not yet freed
        self.freed_behind_windows = 0  # blocks given back behind sliding windows, since start

    @staticmethod
    def storage_shape(spec: ModelSpec, num_blocks: int, block_size: int) -> tuple[int, ...]:
        layers = KVLayout.of(spec, block_size).group_layers
        return (layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)

    @staticmethod
    def bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype | str) -> int:
        """K and V of one block across the layers it holds, scales included: the unit a KV memory budget
        is divided into. `dtype`: a kv_format name, or a float torch dtype."""
        layers = KVLayout.of(spec, block_size).group_layers
        per_token = kv_format.bytes_per_token(
            format_name(dtype), layers, spec.num_kv_heads, spec.head_dim, spec.kv_tensors
        )
        return block_size * per_token

    @classmethod
    def storage_bytes(cls, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype | str) -> int:
        """Bytes `storage_in` lays `num_blocks` out in: the blocks, and for int8 up to SCALE_ALIGN of padding
        before the scales (outside the budget `blocks_in` divides: a cache line, not a block)."""
        fmt = format_name(dtype)
        if not kv_format.is_quantized(fmt):
            return num_blocks * cls.bytes_per_block(spec, block_size, fmt)
        n = spec.kv_tensors
        values = n * _numel(cls.storage_shape(spec, num_blocks, block_size))
        scales = n * _numel(cls.storage_shape(spec, num_blocks, block_size)[:-1]) * kv_format.SCALE_BYTES[fmt]
        return _aligned(values) + scales

    @classmethod
    def storage_in(
        cls, view: ViewFn, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype | str
    ) -> KVStorage:
        """(k, v) storage for `num_blocks` in memory that `view` maps (Segment.tensor: shared memory), in
        `storage_bytes` bytes: K then V values; for int8, then K's scales and V's."""
        fmt = format_name(dtype)
        shape = cls.storage_shape(spec, num_blocks, block_size)
        n = spec.kv_tensors  # 1: MLA's latent row is its own values (V is K)
        if not kv_format.is_quantized(fmt):
            kv = view(0, getattr(torch, fmt), (n, *shape))  # K, then V: the two halves of the block budget
            return kv[0], kv[n - 1]
        values = view(0, torch.int8, (n, *shape))
        scales = view(_aligned(values.numel()), torch.float32, (n, *shape[:-1]))
        return Int8KV(values[0], scales[0]), Int8KV(values[n - 1], scales[n - 1])

    @classmethod
    def blocks_in(cls, nbytes: int, spec: ModelSpec, block_size: int, dtype: torch.dtype | str, budget: str) -> int:
        """Whole blocks a KV memory budget of `nbytes` holds; `budget` names it (the flag) in the
        error, since a budget below one block is an operator's mistake to report at start-up."""
        per_block = cls.bytes_per_block(spec, block_size, dtype)
        if nbytes < per_block:
            raise ValueError(f"{budget} {nbytes} B holds no {per_block} B KV block")
        return nbytes // per_block

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def layer(self, i: int) -> tuple[KVCache, KVCache]:
        """Layer i's K and V caches, (NB, BS, K, Hd) each: its slot in the storage of its group's blocks."""
        slot = self.layout.layer_slot[i]
        return self.k[slot], self.v[slot]

    def length(self, seq_id: int) -> int:
        return self.lengths.get(seq_id, 0)

    def _tables(self) -> list[dict[int, list[int]]]:
        return [self.tables, *self.group_tables]

    def blocks_of(self, seq_id: int) -> int:
        """The blocks `seq_id` holds, in all groups."""
        return sum(sum(1 for b in t.get(seq_id, ()) if b >= 0) for t in self._tables())

    def blocks_needed(self, seq_id: int, new_tokens: int) -> int:
        """Blocks to take for `new_tokens` more, in all groups (after those behind a window are freed)."""
        n = -(-(self.lengths.get(seq_id, 0) + new_tokens) // self.block_size)
        return sum(max(0, n - len(t.get(seq_id, ()))) for t in self._tables())

    def _free_behind_windows(self, seq_id: int) -> None:
        """Gives back each sliding group's blocks that no query from the sequence's next token on reads."""
        start = self.lengths.get(seq_id, 0)
        for g, tables in enumerate(self._tables()):
            table = tables.get(seq_id)
            first = min(self.layout.first_live_block(g, start), len(table or ()))
            done = self._live_from.get((g, seq_id), 0)
            if table is None or first <= done:
                continue
            dead = [b for b in table[done:first] if b >= 0]
            self.allocator.free(dead)
            self.freed_behind_windows += len(dead)
            table[done:first] = [-1] * (first - done)
            self._live_from[(g, seq_id)] = first

    def append(self, seq_ids: list[int], q_lens: list[int]) -> AttentionMetadata:
        """Reserves room for each sequence's new tokens and returns the batch's metadata.

        All-or-nothing: when the blocks do not suffice nothing is allocated (blocks behind a sliding
        window are freed first either way: nothing reads them again).
        """
        for s in seq_ids:
            self._free_behind_windows(s)
        need = sum(self.blocks_needed(s, q) for s, q in zip(seq_ids, q_lens, strict=True))
        if need > self.allocator.num_free:
            raise KVCacheFullError(f"KV cache full: the batch needs {need} more blocks, {self.allocator.num_free} free")
        for s, q in zip(seq_ids, q_lens, strict=True):
            n = -(-(self.lengths.get(s, 0) + q) // self.block_size)
            for tables in self._tables():
                table = tables.setdefault(s, [])
                table.extend(self.allocator.allocate(max(0, n - len(table))))
            self.lengths[s] = self.lengths.get(s, 0) + q
        return AttentionMetadata(
            q_lens=tuple(q_lens),
            ctx_lens=tuple(self.lengths[s] for s in seq_ids),
            block_tables=tuple(tuple(self.tables[s]) for s in seq_ids),
            block_size=self.block_size,
            group_tables=tuple(tuple(tuple(t[s]) for s in seq_ids) for t in self.group_tables),
        )

    def begin(self, seq_ids: list[int], q_lens: list[int], starts: list[int]) -> AttentionMetadata:
        """`append`, after checking that each sequence's cached length is where its step starts (a
        mismatch means the orchestrator and this cache disagree: refuse rather than corrupt)."""
        for s, p in zip(seq_ids, starts, strict=True):
            if self.length(s) != p:
                raise ValueError(f"sequence {s} has {self.length(s)} cached tokens but the step starts at {p}")
        return self.append(seq_ids, q_lens)

    def free(self, seq_id: int) -> None:
        for g, tables in enumerate(self._tables()):
            self.allocator.free([b for b in tables.pop(seq_id, []) if b >= 0])
            self._live_from.pop((g, seq_id), None)
        self.lengths.pop(seq_id, None)

    def reset(self) -> None:
        """Frees every sequence (a new orchestrator session: nothing cached belongs to anyone)."""
        for seq in list(self.lengths):
            self.free(seq)

    def usage(self) -> float:
        """Fraction of blocks in use."""
        a = self.allocator
        return 1.0 - a.num_free / a.num_blocks


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SCALE_ALIGN) * SCALE_ALIGN


def _zeros(device: torch.device | str) -> ViewFn:
    """A ViewFn over fresh zeroed memory of its own (the offsets do not matter: each view is separate)."""
    return lambda _offset, dtype, shape: torch.zeros(shape, dtype=dtype, device=device)
