"""GQA attention over a paged KV cache, for ragged batches of prefill and decode sequences.

The cache of one layer is (NB, BS, K, Hd) for keys and the same for values: NB blocks of BS token
slots. A sequence owns a list of blocks (its block table) in any order; token p of a sequence lives in
block `table[p // BS]` at offset `p % BS`. Nothing is padded: the flattened batch holds each
sequence's new tokens back to back.

A cache is a float tensor (it stores K/V rounded to its dtype) or an `Int8KV`: int8 values and one
fp32 scale per token per KV head (docs/kv-cache.md). Attention dequantizes only what one chunk
gathers, into fp32, never the whole cache.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from moe_lightning import native


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Describes a ragged batch: per sequence, how many new tokens and how long the context is."""

    q_lens: tuple[int, ...]  # (B,) new tokens of each sequence in this batch
    ctx_lens: tuple[int, ...]  # (B,) tokens in the cache once the new ones are appended
    block_tables: tuple[tuple[int, ...], ...]  # (B, blocks of that sequence)
    block_size: int
    # the tables of a cache's other layer groups (kv_layout.py), each (B, blocks): sliding-window layers
    # keep blocks of their own, -1 where a block behind the window went back to the pool
    group_tables: tuple[tuple[tuple[int, ...], ...], ...] = ()

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
    def num_groups(self) -> int:
        return 1 + len(self.group_tables)

    def group(self, g: int) -> AttentionMetadata:
        """The batch as layer group `g`'s layers see it: its block tables."""
        if g == 0:
            return self if not self.group_tables else replace(self, group_tables=())
        return AttentionMetadata(self.q_lens, self.ctx_lens, self.group_tables[g - 1], self.block_size)

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


INT8_MAX = 127  # kv_format.INT8_MAX: symmetric int8, -128 unused


@dataclass(frozen=True, slots=True)
class Int8KV:
    """K (or V) of an int8 cache: values and, per token per KV head, the fp32 scale they were divided by.

    Indexing picks a layer, as it does a float cache's (L, NB, BS, K, Hd) tensor: `cache.k[layer]`
    means the same thing in either format.
    """

    values: torch.Tensor  # ([L,] NB, BS, K, Hd) int8
    scales: torch.Tensor  # ([L,] NB, BS, K) fp32: absmax / 127 of each token's head (0 for an all-zero one)

    def __getitem__(self, layer: int) -> Int8KV:
        return Int8KV(self.values[layer], self.scales[layer])

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device


KVCache = torch.Tensor | Int8KV  # one layer's K (or V) cache, in either format


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (..., Hd) -> int8 values (..., Hd) and fp32 scales (...): symmetric, per row, round to nearest,
    so |x - values * scale| <= absmax / 254 of each row (half a step of absmax / 127)."""
    x = x.float()
    scales = x.abs().amax(-1) / INT8_MAX
    # a zero row divides by the smallest normal instead of 0: its values stay 0 (0 / tiny), no NaN
    values = torch.round(x / scales.clamp_min(torch.finfo(torch.float32).tiny)[..., None])
    return values.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scales


def dequantize_int8(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """values (..., Hd) int8, scales (...) -> fp32 (..., Hd), into `out` when given. Upcast, then scale in
    place: torch's mixed int8 * fp32 multiply is slower on a CPU than these two passes (1.3x on one
    thread, up to ~8x on two)."""
    out = values.float() if out is None else out.copy_(values)
    return out.mul_(scales[..., None])


def write_kv(k_cache: KVCache, v_cache: KVCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Appends new keys/values, rounded to the cache's dtype (or quantized, for an int8 cache).
    k_cache/v_cache: (NB, BS, K, Hd); k/v: (T, K, Hd); slots: (T,)."""
    if isinstance(k_cache, Int8KV) and isinstance(v_cache, Int8KV):
        for cache, x in ((k_cache, k), (v_cache, v)):
            values, scales = quantize_int8(x)
            cache.values.view(-1, *cache.shape[2:])[slots] = values
            cache.scales.view(-1, cache.shape[2])[slots] = scales
        return
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v.to(v_cache.dtype)


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Decode sequences of similar context length, attended as one padded grid of whole blocks."""

    rows: torch.Tensor  # (b,) their rows in the batch
    blocks: torch.Tensor  # (b, Wg) cache block of each grid block (block 0 past a sequence's end, masked)
    mask: torch.Tensor  # (b, 1, 1, Wg * BS) which grid slots attend
    # slots from the grid's start to each sequence's last token: a chunk attends up to its longest one,
    # not to the end of its last block (less work; one sequence alone is attended over exactly its context)
    spans: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SequenceContext:
    """One prefill sequence's attended context as whole blocks, and which of their slots each new token sees."""

    blocks: torch.Tensor  # (nb,) cache blocks in position order
    mask: torch.Tensor  # (q_len, ctx - first block's position): up to its last token, not its last block's end


@dataclass(frozen=True, slots=True)
class DecodeIndex:
    """A decode batch as the native kernel reads it (moe_lightning/native/decode_attention.cpp): int32."""

    tables: torch.Tensor  # (B, W) each sequence's blocks in position order, -1 past its end (never read)
    ctx: torch.Tensor  # (B,) its tokens
    first: torch.Tensor  # (B,) the first position it attends (its window's start, else 0)


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """Index tensors for one batch, built once and reused by every layer (they do not change)."""

    meta: AttentionMetadata
    write_slots: torch.Tensor  # (T,) where each new token's K/V goes
    decode_groups: tuple[DecodeGroup, ...] = ()  # decode: sequences grouped by context length
    sequences: tuple[SequenceContext, ...] = ()  # prefill: one per sequence
    native: DecodeIndex | None = None  # decode on a CPU where the native kernel built: what it reads


PADDING_SLACK = 1.25  # a decode group's padded grid may hold at most this many times its real context
# K+V bytes (as attention reads them) gathered per step of the decode kernel. On a CPU a few MiB stay in the
# caches between the gather (and upcast) and the attention that reads them, and buffers that small do not
# fault in fresh pages every call (a fresh 100 MiB buffer per call ran at a quarter of the speed).
CHUNK_BYTES = {"cpu": 4 << 20}
DEVICE_CHUNK_BYTES = 256 << 20  # elsewhere (CUDA): few large launches


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


def _context_blocks(table: tuple[int, ...], first: int, ctx: int, block_size: int) -> tuple[list[int], int]:
    """The blocks holding positions first..ctx-1, and the position of the first block's slot 0."""
    lo = first // block_size
    return list(table[lo : -(-ctx // block_size)]), lo * block_size


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, ctx: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Causal (and windowed) visibility; every argument broadcasts."""
    mask = (k_pos <= q_pos) & (k_pos < ctx)
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    return mask


def _decode_group(
    meta: AttentionMetadata, rows: list[int], sliding_window: int | None, device: torch.device | str
) -> DecodeGroup:
    bs = meta.block_size
    spans = []
    for b in rows:
        c = meta.ctx_lens[b]
        first = max(0, c - sliding_window) if sliding_window is not None else 0
        spans.append(_context_blocks(meta.block_tables[b], first, c, bs))
    width = max(len(blocks) for blocks, _ in spans)
    blocks = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (bl, _) in enumerate(spans):
        blocks[i, : len(bl)] = torch.tensor(bl, dtype=torch.long)
    ctx = torch.tensor([meta.ctx_lens[b] for b in rows])[:, None]  # (b, 1)
    k_pos = torch.tensor([base for _, base in spans])[:, None] + torch.arange(width * bs)[None, :]  # (b, Wg * BS)
    mask = _visible(ctx - 1, k_pos, ctx, sliding_window)
    ends = tuple(meta.ctx_lens[b] - base for b, (_, base) in zip(rows, spans, strict=True))
    return DecodeGroup(torch.tensor(rows, device=device), blocks.to(device), mask[:, None, None, :].to(device), ends)


def _sequence_context(
    meta: AttentionMetadata, b: int, sliding_window: int | None, device: torch.device | str
) -> SequenceContext:
    q_len, c = meta.q_lens[b], meta.ctx_lens[b]
    first = max(0, c - q_len - sliding_window + 1) if sliding_window is not None else 0
    blocks, base = _context_blocks(meta.block_tables[b], first, c, meta.block_size)
    q_pos = torch.arange(c - q_len, c)[:, None]  # (q_len, 1)
    k_pos = base + torch.arange(c - base)[None, :]  # (1, ctx - base)
    mask = _visible(q_pos, k_pos, torch.tensor(c), sliding_window)
    return SequenceContext(torch.tensor(blocks, dtype=torch.long, device=device), mask.to(device))


def _decode_index(meta: AttentionMetadata, sliding_window: int | None) -> DecodeIndex | None:
    if native.decode_kernel() is None:
        return None
    width = max(len(t) for t in meta.block_tables)
    tables = torch.full((len(meta.block_tables), width), -1, dtype=torch.int32)
    for b, table in enumerate(meta.block_tables):
        tables[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
    ctx = torch.tensor(meta.ctx_lens, dtype=torch.int32)
    first = (ctx - sliding_window).clamp_min(0) if sliding_window is not None else torch.zeros_like(ctx)
    return DecodeIndex(tables, ctx, first.to(torch.int32))


def plan_attention(
    meta: AttentionMetadata, sliding_window: int | None = None, device: torch.device | str = "cpu"
) -> AttentionPlan:
    write_slots = meta.slot_mapping().to(device)
    if meta.is_decode:
        groups = tuple(_decode_group(meta, g, sliding_window, device) for g in _decode_groups(meta.ctx_lens))
        native = _decode_index(meta, sliding_window) if torch.device(device).type == "cpu" else None
        return AttentionPlan(meta, write_slots, groups, native=native)
    seqs = tuple(_sequence_context(meta, b, sliding_window, device) for b in range(len(meta.q_lens)))
    return AttentionPlan(meta, write_slots, (), seqs)


_workspace = threading.local()  # per thread: the attention loop, the engine and calibration may overlap


def _buffer(slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised buffer, kept between calls on a CPU: a fresh multi-MiB one faults its pages in on
    first touch, which took half the time of a small decode call. Chunks far past the budget (one very
    long context) are not kept."""
    n = math.prod(shape)
    if device.type != "cpu" or n * dtype.itemsize > 4 * CHUNK_BYTES["cpu"]:
        return torch.empty(shape, dtype=dtype, device=device)
    # a buffer made under inference_mode cannot be written outside it (nor the reverse): one of each
    key = (slot, dtype, torch.is_inference_mode_enabled())
    kept: dict[tuple[str, torch.dtype, bool], torch.Tensor] = _workspace.__dict__.setdefault("buffers", {})
    buf = kept.get(key)
    if buf is None or buf.numel() < n:
        buf = kept[key] = torch.empty(n, dtype=dtype)
    return buf[:n].view(shape)


class _Gather:
    """Whole blocks of a K or V cache, gathered (and upcast) into a buffer reused chunk after chunk."""

    def __init__(self, name: str, cache: torch.Tensor, max_blocks: int, dtype: torch.dtype) -> None:
        self.cache = cache
        shape = (max_blocks, *cache.shape[1:])
        self.out = _buffer(name, shape, dtype, cache.device)
        same = cache.dtype == dtype
        self.staging = None if same else _buffer(name + "-staging", shape, cache.dtype, cache.device)

    def __call__(self, blocks: torch.Tensor, n: int, span: int) -> torch.Tensor:
        """blocks: (n * W,) for n sequences -> their first `span` slots, (n, span, K, Hd)."""
        m, kv_heads, hd = blocks.numel(), *self.cache.shape[2:]
        if self.staging is None:
            got = torch.index_select(self.cache, 0, blocks, out=self.out[:m])  # (n * W, BS, K, Hd)
        else:
            got = self.out[:m].copy_(torch.index_select(self.cache, 0, blocks, out=self.staging[:m]))
        return got.view(n, -1, kv_heads, hd)[:, :span]


class _GatherInt8:
    """`_Gather` for an int8 cache: a chunk's values and scales gathered, then dequantized into the buffer."""

    def __init__(self, name: str, cache: Int8KV, max_blocks: int, dtype: torch.dtype) -> None:
        self.cache = cache
        shape = (max_blocks, *cache.shape[1:])
        self.out = _buffer(name, shape, dtype, cache.device)
        self.staging = _buffer(name + "-staging", shape, torch.int8, cache.device)
        self.scales = _buffer(name + "-scales", shape[:-1], cache.scales.dtype, cache.device)

    def __call__(self, blocks: torch.Tensor, n: int, span: int) -> torch.Tensor:
        """blocks: (n * W,) for n sequences -> their first `span` slots, (n, span, K, Hd), dequantized."""
        m, kv_heads, hd = blocks.numel(), *self.cache.shape[2:]
        values = torch.index_select(self.cache.values, 0, blocks, out=self.staging[:m])  # (n * W, BS, K, Hd)
        scales = torch.index_select(self.cache.scales, 0, blocks, out=self.scales[:m])  # (n * W, BS, K)
        got = dequantize_int8(values, scales, out=self.out[:m])
        return got.view(n, -1, kv_heads, hd)[:, :span]


def _gather(name: str, cache: KVCache, max_blocks: int, dtype: torch.dtype) -> _Gather | _GatherInt8:
    if isinstance(cache, Int8KV):
        return _GatherInt8(name, cache, max_blocks, dtype)
    return _Gather(name, cache, max_blocks, dtype)


def _blocks_of(cache: KVCache, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One prefill sequence's context blocks (nb, BS, K, Hd) in `dtype`: only these are upcast."""
    if isinstance(cache, Int8KV):  # attended in fp32 whatever q's dtype (paged_attention): dtype is fp32 here
        return dequantize_int8(cache.values.index_select(0, blocks), cache.scales.index_select(0, blocks))
    return cache.index_select(0, blocks).to(dtype)


def _fused(q_dtype: torch.dtype, cache_dtype: torch.dtype, sinks: bool, device_type: str) -> bool:
    """Whether sdpa's fused kernel attends in q's own dtype (see paged_attention)."""
    return not sinks and q_dtype == cache_dtype and (q_dtype != torch.float16 or device_type != "cpu")


def attends_in_fp32(q_dtype: torch.dtype, cache_dtype: torch.dtype, sinks: bool, device_type: str) -> bool:
    """Whether paged_attention attends in fp32, where a host runs the native decode kernel (it is that, to
    fp32 rounding); a 16-bit q over its own cache format stays in sdpa's 16-bit kernel, whose rounding is
    transformers' at that dtype, and never needs the native one (cpu_attention then does not build it)."""
    return not _fused(q_dtype, cache_dtype, sinks, device_type) or q_dtype == torch.float32


def paged_attention(
    q: torch.Tensor, k_cache: KVCache, v_cache: KVCache, plan: AttentionPlan, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal GQA over cached context. q: (T, H, Hd) -> out (T, H * Hd) in q's dtype.

    `sinks` (H,) (GPT-OSS): each head's learned logit joins its softmax and is dropped after it, so
    its weights sum to less than 1; attended in fp32 by `_sink_attention` (sdpa has no sinks).

    The new tokens' K/V must already be in the cache (`write_kv` with `plan.write_slots`). Scores, softmax
    and sums are fp32 whatever the dtypes, and only what one chunk gathers is ever converted, never the
    cache. q and cache in one dtype run sdpa's fused kernel in it: fp32; or bf16, whose kernel computes
    in fp32 inside and rounds the softmax weights to bf16 for P @ V, as transformers' bf16 reference does
    (it is the same kernel); or fp16 off a CPU. Otherwise (an fp32 q over a 16-bit cache, fp16 on a CPU,
    where the fp16 kernel is ~6x slower than fp32; any q over an int8 cache) the gathered chunk is upcast
    (dequantized) and attended in fp32. A CPU decode step that would attend in fp32 runs the native kernel
    instead where it built (`plan.native`; docs/kv-cache.md, "The decode kernel"): the same to fp32
    rounding, its blocks read where they lie.
    """
    t, h, hd = q.shape
    fused = _fused(q.dtype, k_cache.dtype, sinks is not None, q.device.type)
    in_fp32 = attends_in_fp32(q.dtype, k_cache.dtype, sinks is not None, q.device.type)
    if (
        in_fp32
        and plan.native is not None
        and q.device.type == "cpu"
        and native.fits_decode_kernel(h, k_cache.shape[-2], hd)
    ):
        return _native_decode(q, k_cache, v_cache, plan.native, sinks)
    # contiguous: sdpa's fused kernel needs a unit-stride head dim (the weight-major QKV GEMM's output is not)
    work = (q if fused else q.float()).contiguous()
    sink_logits = None if sinks is None else sinks.float()
    out = (_decode if plan.decode_groups else _prefill)(work, k_cache, v_cache, plan, sink_logits)
    return out.to(q.dtype).reshape(t, h * hd)


_NONE = torch.empty(0)


def _native_decode(
    q: torch.Tensor, k_cache: KVCache, v_cache: KVCache, index: DecodeIndex, sinks: torch.Tensor | None
) -> torch.Tensor:
    """The native decode kernel: each KV head's rows read once, where their blocks are, for its G query
    heads; fp32 throughout, whatever the cache's format."""
    t, h, hd = q.shape
    scaled = (q.float() * hd**-0.5).contiguous()
    if isinstance(k_cache, Int8KV) and isinstance(v_cache, Int8KV):
        k, v, k_scales, v_scales = k_cache.values, v_cache.values, k_cache.scales, v_cache.scales
    else:
        k, v, k_scales, v_scales = k_cache, v_cache, _NONE, _NONE
    sink_logits = _NONE if sinks is None else sinks.float().contiguous()
    kernel = native.decode_kernel()
    assert kernel is not None  # (the plan has an index only when it built)
    out = kernel.decode_attention(scaled, k, v, k_scales, v_scales, index.tables, index.ctx, index.first, sink_logits)
    return out.to(q.dtype).reshape(t, h * hd)


SINK_SCORE_BYTES = 64 << 20  # fp32 scores one prefill chunk of `_sink_attention` holds


def _sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """Attention whose softmax also spans one sink logit per query row, as transformers' GPT-OSS eager
    attention computes it (scores, sinks appended, max subtracted, softmax, sinks dropped, P @ V), in fp32.
    q: (..., M, Hd), k/v: (..., L, Hd), mask: bool broadcasting to (..., M, L), sinks: broadcasting to
    (..., M, 1) -> (..., M, Hd)."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5  # (..., M, L)
    scores = scores.masked_fill(~mask, float("-inf"))
    combined = torch.cat([scores, sinks.expand(*scores.shape[:-1], 1)], dim=-1)  # (..., M, L + 1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = torch.softmax(combined, dim=-1)[..., :-1]  # (..., M, L)
    return probs @ v.float()


def _decode(
    q: torch.Tensor, k_cache: KVCache, v_cache: KVCache, plan: AttentionPlan, sinks: torch.Tensor | None
) -> torch.Tensor:
    """One query per sequence. The G query heads that share a KV head are attended as G queries of that
    head, so K/V are read once per KV head and never expanded to H heads."""
    t, h, hd = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    g_size = h // kv_heads
    budget = CHUNK_BYTES.get(q.device.type, DEVICE_CHUNK_BYTES)
    per_block = 2 * bs * kv_heads * hd * q.element_size()  # K+V of one block as attention reads it
    groups = plan.decode_groups
    chunks = [min(g.blocks.shape[0], max(1, budget // (per_block * g.blocks.shape[1]))) for g in groups]
    max_blocks = max(c * g.blocks.shape[1] for c, g in zip(chunks, groups, strict=True))
    gather_k, gather_v = _gather("k", k_cache, max_blocks, q.dtype), _gather("v", v_cache, max_blocks, q.dtype)
    out = torch.empty(t, kv_heads, g_size, hd, dtype=q.dtype, device=q.device)
    qg = q.view(t, kv_heads, g_size, hd)  # (T, K, G, Hd)
    for g, chunk in zip(groups, chunks, strict=True):
        for s in range(0, g.blocks.shape[0], chunk):
            rows, blocks = g.rows[s : s + chunk], g.blocks[s : s + chunk].reshape(-1)
            n, span = rows.numel(), max(g.spans[s : s + chunk])
            k = gather_k(blocks, n, span).transpose(1, 2)  # (n, K, Lg, Hd), strided: sdpa reads it in place
            v = gather_v(blocks, n, span).transpose(1, 2)  # (n, K, Lg, Hd)
            mask = g.mask[s : s + chunk, ..., :span]  # (n, 1, 1, Lg)
            if sinks is None:
                out[rows] = F.scaled_dot_product_attention(qg[rows], k, v, attn_mask=mask)  # (n, K, G, Hd)
            else:  # G query rows per KV head, each with its head's sink
                out[rows] = _sink_attention(qg[rows], k, v, mask, sinks.view(1, kv_heads, g_size, 1))
    return out


def _prefill(
    q: torch.Tensor, k_cache: KVCache, v_cache: KVCache, plan: AttentionPlan, sinks: torch.Tensor | None
) -> torch.Tensor:
    """A sequence at a time: its context's blocks gathered (upcast) once, all its new tokens attend."""
    t, h, hd = q.shape
    kv_heads = k_cache.shape[2]
    out = torch.empty(t, h, hd, dtype=q.dtype, device=q.device)
    start = 0
    for seq, q_len in zip(plan.sequences, plan.meta.q_lens, strict=True):
        span = seq.mask.shape[-1]
        k = _blocks_of(k_cache, seq.blocks, q.dtype).view(-1, kv_heads, hd)[:span].transpose(0, 1)  # (K, L, Hd)
        v = _blocks_of(v_cache, seq.blocks, q.dtype).view(-1, kv_heads, hd)[:span].transpose(0, 1)  # (K, L, Hd)
        qb = q[start : start + q_len].transpose(0, 1)  # (H, q_len, Hd)
        if sinks is not None:
            out[start : start + q_len] = _prefill_with_sinks(qb, k, v, seq.mask, sinks).transpose(0, 1)
            start += q_len
            continue
        # 4-d: sdpa runs its fused kernel on 4-d inputs only (3-d ones take the unfused math path)
        o = F.scaled_dot_product_attention(qb[None], k[None], v[None], attn_mask=seq.mask, enable_gqa=h != kv_heads)
        out[start : start + q_len] = o[0].transpose(0, 1)  # (q_len, H, Hd)
        start += q_len
    return out


def _prefill_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """One sequence: q (H, M, Hd), k/v (K, L, Hd), mask (M, L), sinks (H,) -> (H, M, Hd), the G query
    heads of a KV head attending it together (K/V never expanded), in query chunks whose scores fit
    SINK_SCORE_BYTES."""
    h, m, hd = q.shape
    kv_heads, span = k.shape[0], k.shape[1]
    g = h // kv_heads
    qg = q.reshape(kv_heads, g, m, hd)  # (K, G, M, Hd)
    sink = sinks.view(kv_heads, g, 1, 1)
    rows = max(1, SINK_SCORE_BYTES // (4 * h * span))
    out = torch.empty(kv_heads, g, m, hd, dtype=torch.float32, device=q.device)
    for s in range(0, m, rows):
        e = min(m, s + rows)
        out[:, :, s:e] = _sink_attention(qg[:, :, s:e], k[:, None], v[:, None], mask[s:e], sink)
    return out.view(h, m, hd)
