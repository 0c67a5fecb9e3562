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
class DecodeGroup:
    """Decode sequences of similar context length, attended as one padded (b, Lg) grid."""

    rows: torch.Tensor  # (b,) their rows in the batch
    grid: torch.Tensor  # (b, Lg) flat cache slot of every context position (0 past the end)
    mask: torch.Tensor  # (b, 1, 1, Lg) which grid entries attend


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """Index tensors for one batch, built once and reused by every layer (they do not change)."""

    meta: AttentionMetadata
    write_slots: torch.Tensor  # (T,) where each new token's K/V goes
    decode_groups: tuple[DecodeGroup, ...] = ()  # decode: sequences grouped by context length
    seq_slots: tuple[torch.Tensor, ...] = ()  # prefill: (ctx_b,) per sequence
    seq_masks: tuple[torch.Tensor, ...] = ()  # prefill: (q_len_b, ctx_b) per sequence


PADDING_SLACK = 1.25  # a decode group's padded grid may hold at most this many times its real context


def _decode_groups(ctx_lens: tuple[int, ...]) -> list[list[int]]:
    """Sequences by descending context, cut into groups whose padded grid stays within PADDING_SLACK
    of their real context: one long prompt in a batch does not make every sequence gather its length."""
    order = sorted(range(len(ctx_lens)), key=lambda b: -ctx_lens[b])
    groups: list[list[int]] = []
    total = 0
    for b in order:
        if groups and ctx_lens[groups[-1][0]] * (len(groups[-1]) + 1) <= PADDING_SLACK * (total + ctx_lens[b]):
            groups[-1].append(b)
            total += ctx_lens[b]
        else:
            groups.append([b])
            total = ctx_lens[b]
    return groups


def _decode_group(
    meta: AttentionMetadata, rows: list[int], sliding_window: int | None, device: torch.device | str
) -> DecodeGroup:
    ctx = torch.tensor([meta.ctx_lens[b] for b in rows], dtype=torch.long)
    pos = torch.arange(int(ctx.max()))  # (Lg,)
    width = max(len(meta.block_tables[b]) for b in rows)
    tables = torch.zeros(len(rows), width, dtype=torch.long)
    for i, b in enumerate(rows):
        tables[i, : len(meta.block_tables[b])] = torch.tensor(meta.block_tables[b], dtype=torch.long)
    valid = pos[None, :] < ctx[:, None]  # (b, Lg)
    if sliding_window is not None:
        valid &= (ctx[:, None] - 1 - pos[None, :]) < sliding_window
    block_idx = torch.clamp(pos // meta.block_size, max=width - 1)
    grid = tables[:, block_idx] * meta.block_size + pos % meta.block_size  # (b, Lg)
    grid = torch.where(valid, grid, torch.zeros_like(grid))
    return DecodeGroup(torch.tensor(rows, device=device), grid.to(device), valid[:, None, None, :].to(device))


def plan_attention(
    meta: AttentionMetadata, sliding_window: int | None = None, device: torch.device | str = "cpu"
) -> AttentionPlan:
    write_slots = meta.slot_mapping().to(device)
    if meta.is_decode:
        groups = tuple(_decode_group(meta, g, sliding_window, device) for g in _decode_groups(meta.ctx_lens))
        return AttentionPlan(meta, write_slots, groups)
    slots, masks = [], []
    for b, (q_len, ctx) in enumerate(zip(meta.q_lens, meta.ctx_lens, strict=True)):
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]  # (q_len, 1)
        k_pos = torch.arange(ctx)[None, :]  # (1, ctx)
        mask = k_pos <= q_pos  # (q_len, ctx)
        if sliding_window is not None:
            mask &= q_pos - k_pos < sliding_window
        slots.append(meta.context_slots(b).to(device))
        masks.append(mask.to(device))
    return AttentionPlan(meta, write_slots, (), tuple(slots), tuple(masks))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """Causal GQA over cached context. q: (T, H, Hd) -> out (T, H * Hd).

    The new tokens' K/V must already be in the cache (`write_kv` with `plan.write_slots`).
    """
    t, h, hd = q.shape
    kv_heads = k_cache.shape[2]
    k_flat = k_cache.view(-1, kv_heads, hd)  # (NB * BS, K, Hd)
    v_flat = v_cache.view(-1, kv_heads, hd)
    gqa = h != kv_heads
    if plan.decode_groups:
        # One query per sequence: per group, gather each context into a (b, Lg) grid, mask the tail.
        out = torch.empty(t, h, hd, dtype=q.dtype, device=q.device)
        for g in plan.decode_groups:
            k = k_flat[g.grid].transpose(1, 2)  # (b, K, Lg, Hd)
            v = v_flat[g.grid].transpose(1, 2)  # (b, K, Lg, Hd)
            qg = q[g.rows][:, :, None, :]  # (b, H, 1, Hd)
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, enable_gqa=gqa)  # (b, H, 1, Hd)
            out[g.rows] = o[:, :, 0, :]
        return out.reshape(t, h * hd)
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
