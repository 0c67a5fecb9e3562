"""Hand-off slots in the activations' dtype, and MLA's latent sent once (issue 53, item 2): slots were
4 bytes an element whatever the stack ran in, and MLA's latent row went twice (as k and as v), so
DeepSeek-V3's channels took 19.5 GB of pinned shared memory at the defaults."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.handoff import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_SLOTS,
    AttentionHandoff,
    HandoffHeader,
    QKVHandoff,
    SequenceBatch,
    attention_width,
    decode_expert_message,
    handoff_slot_bytes,
)
from moe_lightning.hrm.archs import ARCHS
from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.launcher import Stack
from moe_lightning.shm.channel import TensorChannel
from moe_lightning.shm.segment import SHM_DIR, list_segments, segment_name
from moe_lightning.spec import ModelSpec
from moe_lightning.stages.attend import attend, plan_batch
from services.cpu_attention.worker import AttentionWorker
from services.gpu_expert.handoff_link import HandoffLink

from reference import save_hf
from test_families import CONFIGS

DEEPSEEK = ARCHS["deepseek-v3"]  # 128 heads over one latent "KV head" of C + R = 512 + 64
FIXED = {"qkv": 3 * 8, "attn": 0}  # bytes a token takes whatever the dtype: the sequence table's row
EXTRA = {"qkv": 4 * 64, "attn": 4096 + 4 * 64}  # alignment, and an error's text


def test_deepseek_v3_slots_at_the_defaults_in_bf16() -> None:
    """Before: q/k/v slots of 8192 x (128 + 2) x 576 x 4 bytes (+ the sequence table) = 2,453,864,704
    and attention slots of 8192 x 128 x 576 x 4 = 2,415,923,456: 19,479,152,640 bytes of channels at 4
    slots each way. Now bf16, the latent once and the reply's H x C: 9,165,359,104 (-53 %)."""
    h, c, hd = DEEPSEEK.num_heads, DEEPSEEK.kv_lora_rank, DEEPSEEK.head_dim
    assert (h, c, hd, DEEPSEEK.num_kv_heads, DEFAULT_MAX_TOKENS, DEFAULT_SLOTS) == (128, 512, 576, 1, 8192, 4)
    qkv, attn = (handoff_slot_bytes(DEEPSEEK, DEFAULT_MAX_TOKENS, kind, torch.bfloat16) for kind in ("qkv", "attn"))
    assert qkv == 8192 * ((h + 1) * hd * 2 + 24) + 256 == 1_217_593_600
    assert attn == 8192 * h * c * 2 + 4096 + 256 == 1_073_746_176
    assert DEFAULT_SLOTS * (qkv + attn) == 9_165_359_104
    assert handoff_slot_bytes(DEEPSEEK, DEFAULT_MAX_TOKENS, "qkv") == 8192 * ((h + 1) * hd * 4 + 24) + 256  # fp32


@pytest.mark.parametrize("arch", ["deepseek-v3", "mixtral-8x7b", "gpt-oss-120b", "glm-4.5-air"])
def test_bf16_slots_hold_half_the_activation_bytes_of_fp32(arch: str) -> None:
    spec, tokens = ARCHS[arch], 1000
    for kind in ("qkv", "attn"):
        payload = {
            d: handoff_slot_bytes(spec, tokens, kind, d) - tokens * FIXED[kind] - EXTRA[kind]
            for d in (torch.bfloat16, torch.float16, torch.float32)
        }
        assert (
            payload[torch.bfloat16] == payload[torch.float16] and 2 * payload[torch.bfloat16] == payload[torch.float32]
        )
    gqa = spec.attention == "gqa"
    kv = 2 if gqa else 1
    values = (spec.num_heads + kv * spec.num_kv_heads) * spec.head_dim
    assert handoff_slot_bytes(spec, tokens, "qkv", torch.bfloat16) == tokens * (values * 2 + 24) + 256
    assert attention_width(spec) == spec.num_heads * (spec.head_dim if gqa else spec.kv_lora_rank)


# --- the message: the latent once, decoded as both k and v -----------------------------------------
def _mla_message(t: int, seed: int = 0) -> QKVHandoff:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, DEEPSEEK.num_heads, DEEPSEEK.head_dim, generator=g).to(torch.bfloat16)
    latent = torch.randn(t, 1, DEEPSEEK.head_dim, generator=g).to(torch.bfloat16)
    batch = SequenceBatch([3, 5], [t - 1, 1], [0, 0])
    return QKVHandoff(HandoffHeader(1, 0, 0, 7), q, latent, latent, batch)  # as pre_attention gives it: k is v


@pytest.fixture()
def qkv_channel() -> Iterator[Callable[[int], tuple[HandoffLink, TensorChannel]]]:
    made: list[TensorChannel] = []

    def make(slot_bytes: int) -> tuple[HandoffLink, TensorChannel]:
        out = TensorChannel.create(segment_name(f"slots{os.getpid()}", "gpu_expert", f"qkv{len(made)}"), 1, slot_bytes)
        made.append(out)
        made.append(TensorChannel.attach(out.name))
        return HandoffLink(out, torch.device("cpu")), made[-1]

    yield make
    for ch in reversed(made):
        ch.close()


def test_an_mla_handoff_round_trip_carries_the_latent_once(qkv_channel: Callable) -> None:
    """Through gpu_expert's link and a real channel of one bf16 slot for 4 tokens: q, the latent and
    the sequence table (594,496 of its 594,784 bytes); the latent twice would not fit."""
    t = 4
    link, reader = qkv_channel(handoff_slot_bytes(DEEPSEEK, t, "qkv", torch.bfloat16))
    msg = _mla_message(t)
    link.send(msg)
    meta, tensors = reader.recv()
    assert [(t.dtype, tuple(t.shape)) for t in tensors] == [
        (torch.bfloat16, (4, 128, 576)),
        (torch.bfloat16, (4, 1, 576)),
        (torch.int64, (3, 2)),
    ]
    assert sum(x.numel() * x.element_size() for x in tensors) == 4 * 128 * 576 * 2 + 4 * 576 * 2 + 48
    got = decode_expert_message(meta, tensors)
    assert isinstance(got, QKVHandoff) and got.k is got.v and got.batch == msg.batch
    assert torch.equal(got.q, msg.q) and torch.equal(got.k, msg.k)
    got.check(DEEPSEEK)
    reader.release()
    twice = QKVHandoff(msg.header, msg.q, msg.k, msg.k.clone(), msg.batch)  # k and v two tensors: GQA's form
    with pytest.raises(ValueError, match="exceeds the slot size"):
        link.send(twice)


def test_a_malformed_handoff_is_still_refused() -> None:
    msg = _mla_message(4)
    header = msg.header.pack()
    q, latent, table = msg.tensors()
    for tensors in ([q], [q, table], [q, latent, latent, latent], [q.long(), latent, table], [q, latent, table[:2]]):
        with pytest.raises(ValueError):
            decode_expert_message(header, tensors)
    gqa = ARCHS["mixtral-8x7b"]
    with pytest.raises(ValueError, match="does not fit the model"):  # one latent where k and v are due
        decode_expert_message(header, [q, latent, table]).check(gqa)
    with pytest.raises(ValueError, match="does not fit the model"):  # k and v where MLA's latent is due
        decode_expert_message(header, [q, latent, latent.clone(), table]).check(DEEPSEEK)
    with pytest.raises(ValueError, match="does not fit the model"):  # a wrong head count
        decode_expert_message(header, [q[:, :64], latent, table]).check(DEEPSEEK)


def test_cpu_attention_attends_the_one_latent_as_k_and_v() -> None:
    """The real worker on DeepSeek-V3's shape: the reply is what attend gives with k = v = the latent,
    bit for bit, (T, H x C) in bf16 in a slot of H x C values a token; a message of the wrong form is
    answered FAILED_PRECONDITION and the worker serves on."""
    run, t = f"mla{os.getpid()}", 4
    worker = AttentionWorker(
        DEEPSEEK, 8, 4, run, handoff_slot_bytes(DEEPSEEK, t, "attn", torch.bfloat16), 2, kv_dtype=torch.bfloat16
    )
    worker.start()
    qkv_slot = handoff_slot_bytes(DEEPSEEK, 2 * t, "qkv", torch.bfloat16)  # room for the malformed one
    out = TensorChannel.create(segment_name(run, "gpu_expert", "qkv"), 2, qkv_slot)
    replies = None
    try:
        worker.connect(out.name, session=7)
        replies = TensorChannel.attach(worker.output.name)
        bad = _mla_message(t, seed=1)
        out.send(bad.header.pack(), [bad.q, bad.k, bad.k.clone(), bad.batch.to_tensor()])  # the latent twice
        failed = AttentionHandoff.decode(*replies.recv(timeout=30))
        replies.release()
        assert failed.header.status_code == grpc.StatusCode.FAILED_PRECONDITION and "does not fit" in failed.error
        msg = _mla_message(t)
        out.send(msg.header.pack(), msg.tensors())
        reply = AttentionHandoff.decode(*replies.recv(timeout=30))
        assert reply.header.status == 0 and reply.out is not None
        assert reply.out.dtype == torch.bfloat16 and tuple(reply.out.shape) == (t, 128 * 512)
        cache = PagedKVCache(DEEPSEEK, 8, 4, torch.bfloat16)
        plans = plan_batch(DEEPSEEK, cache.begin(msg.batch.seq_ids, msg.batch.q_lens, msg.batch.starts))
        kc, vc = cache.layer(0)
        want = attend(DEEPSEEK, msg.q, msg.k, msg.k, kc, vc, plans[0])
        assert torch.equal(reply.out, want)
        replies.release()
    finally:
        if replies is not None:
            replies.close()
        out.close()
        worker.stop()
    assert list_segments(run) == []


# --- a bf16 MLA stack: its channels as sized ---------------------------------------------------------
def _slot_bytes(name: str) -> tuple[int, int]:
    """(slots, slot bytes) from a channel's header in /dev/shm, read without attaching to it."""
    with open(SHM_DIR / name, "rb") as f:
        _, slots, slot_bytes = struct.unpack("<QQQ", f.read(24))
    return slots, slot_bytes


def test_a_bf16_mla_stack_sizes_its_channels_in_bf16_with_the_latent_once(
    tmp_path_factory: pytest.TempPathFactory, make_stack: Callable[..., Stack]
) -> None:
    """DeepSeek-V3's attention in bf16 on both sides: through the hand-off (the latent once, in slots of
    half an fp32 stack's activation bytes) the tokens are those of attention on the device (no hand-off)."""
    family, overrides = CONFIGS["deepseek_v3_mla_yarn_groups"]
    model = save_hf(family, tmp_path_factory.mktemp("deepseek_bf16"), seed=7, **overrides)
    spec = ModelSpec.from_pretrained(model)
    prompts = [[1, 17, 42, 99, 7, 3, 150, 11], [1, 190, 5]]
    tokens = {}
    for attention in ("cpu", "gpu"):
        stack = make_stack(
            model=model,
            dtype="bfloat16",
            kv_cache_memory="8MiB",
            device_kv_memory="8MiB" if attention == "gpu" else None,
            attention_placement=attention,
            timeout=600,
        )
        with GenerationClient(stack.api_address, timeout=300) as c:
            done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=6, ignore_eos=True) for p in prompts])
        tokens[attention] = [d.token_ids for d in done]
        if attention == "cpu":
            names = {n.rsplit(".", 1)[-1]: n for n in list_segments(stack.config.run_id) if not n.startswith("sem.")}
            for kind in ("qkv", "attn"):
                slots, got = _slot_bytes(names[kind])
                fixed = DEFAULT_MAX_TOKENS * FIXED[kind] + EXTRA[kind]
                fp32 = handoff_slot_bytes(spec, DEFAULT_MAX_TOKENS, kind, torch.float32)
                assert slots == DEFAULT_SLOTS and got == handoff_slot_bytes(
                    spec, DEFAULT_MAX_TOKENS, kind, torch.bfloat16
                )
                assert 2 * (got - fixed) == fp32 - fixed  # half an fp32 stack's activation bytes
        stack.stop()
    assert tokens["cpu"] == tokens["gpu"] and [len(t) for t in tokens["cpu"]] == [6, 6]
