"""The per-layer hand-off protocol between the expert service and the attention service.

Expert -> attention, one message per (step, layer, micro-batch): a `HandoffHeader` and tensors
q (T, H, Hd), k (T, K, Hd), v (T, K, Hd), with MLA q and the latent row (T, 1, C + R) once, which
the receiver takes as both k and v; at layer 0 also the micro-batch's sequences as one (3, B) int64
tensor (ids, new tokens, cached tokens before this step), which attention keeps for the later
layers of the step. The tensors' count and dtypes say which: floating q/k/v or q/latent, then the
table when there is one. Attention -> expert: the same header, then the attention service's
compute time for the message (u64 ns: what the HRM's attention row is measured by, where the expert
side's wait shows only what its other micro-batches did not hide), and one tensor (T, H * Hd); or a
non-zero status (a gRPC status code number) and the error text as a uint8 tensor.

Finished sequences leave the same way (docs/design.md, "The hand-off message"): a step's release
list goes ahead of its first hand-off as `ReleaseHandoff` messages (layer `RELEASE_LAYER`, one
(R,) int64 tensor of ids, as many messages as the slot size needs). Attention frees their KV
blocks before it starts the step's new sequences, and sends no reply.

Flow control (docs/design.md, CGOPipe): the expert side keeps at most `pipeline_window(...)`
messages outstanding (sent, reply not yet read). Both channels then hold at most that many
messages, so neither side ever blocks on a full channel while the other waits for it: any number
of micro-batches works with any number of slots.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import grpc
import torch

from moe_lightning.service.limits import DEFAULT_MAX_TOKENS as DEFAULT_MAX_TOKENS
from moe_lightning.service.limits import DEFAULT_SLOTS as DEFAULT_SLOTS
from moe_lightning.spec import ModelSpec

MAX_ERROR_BYTES = 4096  # an error's text is cut to this (it still travels in the slot)
_HEADER = struct.Struct("<QQIII")  # step, session, layer, micro-batch, status
_BUSY = struct.Struct("<Q")  # after a reply's header: the attention service's compute for it, ns
RELEASE_LAYER = 0xFFFFFFFF  # the header's layer of a release message (no layer has this index)
_ALIGN = 64  # the channel aligns each tensor in a slot to this
_STATUS = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(frozen=True, slots=True)
class HandoffHeader:
    """Every hand-off message's header, both directions."""

    step: int
    layer: int
    micro_batch: int
    session: int  # a message of another session is left over from before a restart: stale
    status: int = 0  # a gRPC status code number; 0 (OK) for a result

    def pack(self) -> bytes:
        return _HEADER.pack(self.step, self.session, self.layer, self.micro_batch, self.status)

    @classmethod
    def unpack(cls, data: bytes) -> HandoffHeader:
        step, session, layer, micro_batch, status = _HEADER.unpack(data[: _HEADER.size])
        return cls(step, layer, micro_batch, session, status)

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.step, self.layer, self.micro_batch)

    @property
    def status_code(self) -> grpc.StatusCode:
        return _STATUS.get(self.status, grpc.StatusCode.UNKNOWN)


@dataclass(frozen=True, slots=True)
class SequenceBatch:
    """The sequences of one micro-batch, in order: their ids, new tokens and cached tokens."""

    seq_ids: list[int]
    q_lens: list[int]
    starts: list[int]

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([self.seq_ids, self.q_lens, self.starts], dtype=torch.int64)  # (3, B)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> SequenceBatch:
        ids, q_lens, starts = t.tolist()
        return cls(ids, q_lens, starts)


@dataclass(slots=True)
class QKVHandoff:
    """`v is k` (MLA: the latent row is both, stages/pre_attention.py): it travels once."""

    header: HandoffHeader
    q: torch.Tensor  # (T, H, Hd)
    k: torch.Tensor  # (T, K, Hd)
    v: torch.Tensor  # (T, K, Hd)
    batch: SequenceBatch | None = None  # layer 0 only

    @property
    def shared_kv(self) -> bool:
        return self.v is self.k

    def tensors(self) -> list[torch.Tensor]:
        kv = [self.k] if self.shared_kv else [self.k, self.v]
        extra = [] if self.batch is None else [self.batch.to_tensor()]
        return [self.q, *kv, *extra]

    @classmethod
    def decode(cls, meta: bytes, tensors: list[torch.Tensor]) -> QKVHandoff:
        header = HandoffHeader.unpack(meta)
        table = bool(tensors) and tensors[-1].dtype == torch.int64  # the sequence table goes last
        acts = tensors[:-1] if table else tensors
        if len(acts) not in (2, 3) or not all(t.is_floating_point() for t in acts):
            got = ", ".join(f"{t.dtype} {tuple(t.shape)}" for t in tensors) or "none"
            raise ValueError(
                "a q/k/v hand-off carries q, k and v (or q and one latent for both), then at most the "
                f"(3, B) int64 sequence table; got {got}"
            )
        if table and (tensors[-1].dim() != 2 or tensors[-1].shape[0] != 3):
            raise ValueError(f"a hand-off's sequence table is (3, B) int64, got {tuple(tensors[-1].shape)}")
        batch = SequenceBatch.from_tensor(tensors[-1]) if table else None
        q, k = acts[0], acts[1]
        return cls(header, q, k, acts[2] if len(acts) == 3 else k, batch)

    def check(self, spec: ModelSpec) -> None:
        """ValueError unless q is (T, H, Hd), k and v (T, K, Hd), and k is v exactly for MLA."""
        t, h, k, hd = self.q.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
        mla = spec.attention == "mla"
        shapes = [tuple(self.q.shape), tuple(self.k.shape), tuple(self.v.shape)]
        if shapes != [(t, h, hd), (t, k, hd), (t, k, hd)] or self.shared_kv != mla:
            want = f"q ({t}, {h}, {hd}) and " + (f"one latent ({t}, 1, {hd})" if mla else f"k, v ({t}, {k}, {hd})")
            raise ValueError(f"the hand-off does not fit the model: {want} expected, got {shapes}")


@dataclass(slots=True)
class ReleaseHandoff:
    """Sequences that finished: attention drops their KV blocks. No reply."""

    header: HandoffHeader
    seq_ids: list[int]

    def tensors(self) -> list[torch.Tensor]:
        return [torch.tensor(self.seq_ids, dtype=torch.int64)]

    @classmethod
    def chunks(cls, step: int, session: int, seq_ids: list[int], slot_bytes: int) -> list[ReleaseHandoff]:
        """The messages that carry `seq_ids` through slots of `slot_bytes`."""
        per_message = max(1, (slot_bytes - _ALIGN) // 8)
        header = HandoffHeader(step, RELEASE_LAYER, 0, session)
        return [cls(header, seq_ids[i : i + per_message]) for i in range(0, len(seq_ids), per_message)]


def decode_expert_message(meta: bytes, tensors: list[torch.Tensor]) -> QKVHandoff | ReleaseHandoff:
    """What the expert side sent: q/k/v of one (layer, micro-batch), or a release list."""
    header = HandoffHeader.unpack(meta)
    if header.layer == RELEASE_LAYER:
        if len(tensors) != 1:
            raise ValueError(f"a release hand-off carries 1 tensor, got {len(tensors)}")
        return ReleaseHandoff(header, tensors[0].tolist())
    return QKVHandoff.decode(meta, tensors)


@dataclass(slots=True)
class AttentionHandoff:
    header: HandoffHeader
    out: torch.Tensor | None = None  # (T, H * Hd); None with an error
    error: str = ""
    busy_ns: int = 0  # the attention service's compute for this message (0 with an error)

    def meta(self) -> bytes:
        return self.header.pack() + _BUSY.pack(self.busy_ns)

    def tensors(self) -> list[torch.Tensor]:
        if self.out is not None:
            return [self.out]
        text = self.error.encode()[:MAX_ERROR_BYTES]
        return [torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else torch.empty(0, dtype=torch.uint8)]

    @classmethod
    def failed(cls, header: HandoffHeader, code: grpc.StatusCode, error: str) -> AttentionHandoff:
        h = HandoffHeader(header.step, header.layer, header.micro_batch, header.session, code.value[0])
        return cls(h, None, error)

    @classmethod
    def decode(cls, meta: bytes, tensors: list[torch.Tensor]) -> AttentionHandoff:
        header = HandoffHeader.unpack(meta)
        if header.status:
            return cls(header, None, bytes(tensors[0].numpy()).decode(errors="replace") if tensors else "")
        (busy,) = _BUSY.unpack_from(meta, _HEADER.size)
        return cls(header, tensors[0], busy_ns=busy)


def pipeline_window(num_micro_batches: int, out_slots: int, in_slots: int) -> int:
    """Messages the expert side may have outstanding: no more than either channel holds, and no
    more than one layer's micro-batches (layer l + 1 of a micro-batch needs layer l's reply)."""
    return max(1, min(num_micro_batches, out_slots, in_slots))


def attention_width(spec: ModelSpec) -> int:
    """Values per token of attention's result: H * Hd, with MLA the attended latents H * C."""
    return spec.num_heads * (spec.kv_lora_rank if spec.attention == "mla" else spec.head_dim)


def handoff_slot_bytes(spec: ModelSpec, max_tokens: int, kind: str, dtype: torch.dtype = torch.float32) -> int:
    """Slot size for one message of up to `max_tokens` tokens; kind is "qkv" or "attn". `dtype`: the
    activations' (the weights' dtype, which both workers read off the manifest); float32, the widest,
    for a caller that does not know it. K/V count once with MLA (the latent is both)."""
    size = dtype.itemsize
    align = 4 * _ALIGN  # up to four tensors, each aligned
    if kind == "qkv":
        per_token = (spec.num_heads + spec.kv_tensors * spec.num_kv_heads) * spec.head_dim * size
        per_token += 3 * 8  # the layer-0 sequence table: at most one sequence per token
        extra = 0
    elif kind == "attn":
        per_token = attention_width(spec) * size
        extra = MAX_ERROR_BYTES
    else:
        raise ValueError(f"kind must be 'qkv' or 'attn', got {kind!r}")
    return max_tokens * per_token + extra + align
