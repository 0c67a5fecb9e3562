"""GQA attention over a paged KV cache, for ragged batches of prefill and decode sequences.

The cache of one layer is (NB, BS, K, Hd) for keys and the same for values: NB blocks of BS token
slots. A sequence owns a list of blocks (its block table) in any order; token p of a sequence lives in
block `table[p // BS]` at offset `p % BS`. Nothing is padded: the flattened batch holds each
sequence's new tokens back to back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Describes a ragged batch: per sequence, how many new tokens and how long the context is."""

    q_lens: tuple[int, ...]  # (B,) new tokens of each sequence in this batch
    ctx_lens: tuple[int, ...]  # (B,) tokens in the cache once the new ones are appended
    block_tables: tuple[tuple[int, ...], ...]  # (B, blocks of that sequence)
    block_size: int

    def __post_init__(self) -> None:
        if not len(self.q_lens) == len(self.ctx_lens) == len(self.block_tables):
            raise ValueError("q_lens, ctx_lens and block_tables must have one entry per sequence")
        for b, (q, c, table) in enumerate(zip(self.q_lens, self.ctx_lens, self.block_tables, strict=True)):
            if q <= 0 or c < q:
                raise ValueError(f"sequence {b}: need 0 < q_len <= ctx_len, got q_len={q}, ctx_len={c}")
            if len(table) * self.block_size < c:
                raise ValueError(f"sequence {b}: {len(table)} blocks of {self.block_size} cannot hold {c} tokens")

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.q_lens)

    def positions(self) -> torch.Tensor:
        """(T,) position of every new token in its own sequence."""
        return torch.cat(
            [torch.arange(c - q, c, dtype=torch.long) for q, c in zip(self.q_lens, self.ctx_lens, strict=True)]
        )

    def slot_mapping(self) -> torch.Tensor:
        """(T,) flat cache slot (block * BS + offset) for every new token."""
        pos = self.positions()
        tables = self._token_tables()
        return tables * self.block_size + pos % self.block_size

    def _token_tables(self) -> torch.Tensor:
        blocks = []
        for q, c, table in zip(self.q_lens, self.ctx_lens, self.block_tables, strict=True):
            t = torch.tensor(table, dtype=torch.long)
            blocks.append(t[torch.arange(c - q, c) // self.block_size])
        return torch.cat(blocks)

    def context_slots(self, b: int) -> torch.Tensor:
        """(ctx_len,) flat cache slots of sequence b's whole context, in position order."""
        c = self.ctx_lens[b]
        pos = torch.arange(c)
        table = torch.tensor(self.block_tables[b], dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Appends new keys/values. k_cache/v_cache: (NB, BS, K, Hd); k/v: (T, K, Hd); slots: (T,)."""
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """Index tensors for one batch, built once and reused by every layer (they do not change)."""

    meta: AttentionMetadata
    write_slots: torch.Tensor  # (T,) where each new token's K/V goes
    grid: torch.Tensor | None  # decode: (B, Lmax) flat slot of every context position
    grid_mask: torch.Tensor | None  # decode: (B, 1, 1, Lmax) which grid entries attend
    seq_slots: tuple[torch.Tensor, ...] = ()  # prefill: (ctx_b,) per sequence
    seq_masks: tuple[torch.Tensor, ...] = ()  # prefill: (q_len_b, ctx_b) per sequence


def plan_attention(
    meta: AttentionMetadata, sliding_window: int | None = None, device: torch.device | str = "cpu"
) -> AttentionPlan:
    write_slots = meta.slot_mapping().to(device)
    if meta.is_decode:
        ctx = torch.tensor(meta.ctx_lens, dtype=torch.long)
        pos = torch.arange(int(ctx.max()))  # (Lmax,)
        width = max(len(t) for t in meta.block_tables)
        tables = torch.zeros(len(ctx), width, dtype=torch.long)
        for i, table in enumerate(meta.block_tables):
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)
        valid = pos[None, :] < ctx[:, None]  # (B, Lmax)
        if sliding_window is not None:
            valid &= (ctx[:, None] - 1 - pos[None, :]) < sliding_window
        block_idx = torch.clamp(pos // meta.block_size, max=width - 1)
        grid = tables[:, block_idx] * meta.block_size + pos % meta.block_size  # (B, Lmax)
        grid = torch.where(valid, grid, torch.zeros_like(grid))
        return AttentionPlan(meta, write_slots, grid.to(device), valid[:, None, None, :].to(device))
    slots, masks = [], []
    for b, (q_len, ctx) in enumerate(zip(meta.q_lens, meta.ctx_lens, strict=True)):
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]  # (q_len, 1)
        k_pos = torch.arange(ctx)[None, :]  # (1, ctx)
        mask = k_pos <= q_pos  # (q_len, ctx)
        if sliding_window is not None:
            mask &= q_pos - k_pos < sliding_window
        slots.append(meta.context_slots(b).to(device))
        masks.append(mask.to(device))
    return AttentionPlan(meta, write_slots, None, None, tuple(slots), tuple(masks))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """Causal GQA over cached context. q: (T, H, Hd) -> out (T, H * Hd).

    The new tokens' K/V must already be in the cache (`write_kv` with `plan.write_slots`).
    """
    t, h, hd = q.shape
    kv_heads = k_cache.shape[2]
    k_flat = k_cache.view(-1, kv_heads, hd)  # (NB * BS, K, Hd)
    v_flat = v_cache.view(-1, kv_heads, hd)
    gqa = h != kv_heads
    if plan.grid is not None:
        # One query per sequence: gather every context into a (B, Lmax) grid, mask the tail.
        k = k_flat[plan.grid].transpose(1, 2)  # (B, K, Lmax, Hd)
        v = v_flat[plan.grid].transpose(1, 2)  # (B, K, Lmax, Hd)
        o = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=plan.grid_mask, enable_gqa=gqa)
        return o.reshape(t, h * hd)  # (B, H, 1, Hd) -> (T, H * Hd)
    out = torch.empty(t, h, hd, dtype=q.dtype, device=q.device)
    start = 0
    for slots, mask, q_len in zip(plan.seq_slots, plan.seq_masks, plan.meta.q_lens, strict=True):
        k = k_flat[slots].transpose(0, 1)  # (K, ctx, Hd)
        v = v_flat[slots].transpose(0, 1)  # (K, ctx, Hd)
        qb = q[start : start + q_len].transpose(0, 1)  # (H, q_len, Hd)
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, enable_gqa=gqa)  # (H, q_len, Hd)
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out.reshape(t, h * hd)
