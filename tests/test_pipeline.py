"""CGOPipe's order and the hand-off's flow control: the schedule as a pure function, then the real
expert runner and attention worker over real shared-memory channels with far more micro-batches
than slots, exact against the in-process engine."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY
from runner_pair import arena_of, wired

from moe_lightning.arena import ArenaLayout, weights_from_arena
from moe_lightning.engine import InProcessEngine
from moe_lightning.handoff import (
    RELEASE_LAYER,
    ReleaseHandoff,
    decode_expert_message,
    pipeline_window,
)
from moe_lightning.request import GenerationRequest
from moe_lightning.sampling import SamplingParams
from moe_lightning.spec import ModelSpec
from moe_lightning.step_protocol import SequenceWork, StepKind, StepPlan
from services.gpu_expert.routing import EXPORT_EVERY
from services.gpu_expert.runner import ExpertRunner
from services.gpu_expert.schedule import (
    COLLECT,
    GROUP_FFN,
    RECEIVE,
    SEND,
    capped_groups,
    cgopipe_order,
    group_bounds,
    grouped_order,
    sequential_order,
)


@pytest.mark.parametrize(("layers", "n_ub", "window"), [(1, 1, 1), (3, 5, 2), (4, 16, 4), (2, 3, 8), (8, 20, 20)])
def test_the_order_keeps_the_window_and_each_micro_batchs_layer_order(layers: int, n_ub: int, window: int) -> None:
    ops = list(cgopipe_order(layers, n_ub, window))
    sends = [(o.layer, o.micro_batch) for o in ops if o.kind == SEND]
    receives = [(o.layer, o.micro_batch) for o in ops if o.kind == RECEIVE]
    flat = [divmod(i, n_ub) for i in range(layers * n_ub)]
    assert sends == flat and receives == flat  # both channels are FIFO
    outstanding, done = 0, set()
    for o in ops:
        if o.kind == SEND:
            assert o.layer == 0 or (o.layer - 1, o.micro_batch) in done  # its input is layer l-1's result
            outstanding += 1
            assert outstanding <= min(window, n_ub)
        else:
            outstanding -= 1
            done.add((o.layer, o.micro_batch))
    assert outstanding == 0


def test_with_a_full_window_a_result_is_followed_by_the_next_layers_send() -> None:
    """receive (l, m) -> post-attention -> pre-attention (l+1, m) -> send (l+1, m): no layer barrier,
    attention of (l+1, m) overlaps the device's work on (l, m+1)."""
    ops = list(cgopipe_order(3, 4, 4))
    for a, b in itertools.pairwise(ops):
        if a.kind == RECEIVE and a.layer < 2:
            assert (b.kind, b.layer, b.micro_batch) == (SEND, a.layer + 1, a.micro_batch)
    baseline = list(sequential_order(2, 3))
    assert [o.kind for o in baseline] == [SEND, RECEIVE] * 6


@pytest.mark.parametrize(
    ("layers", "n_ub", "window", "groups"), [(1, 1, 1, 1), (3, 5, 2, 2), (4, 16, 4, 2), (2, 3, 8, 1), (5, 7, 7, 3)]
)
def test_the_grouped_order_runs_each_groups_ffn_before_its_next_layer(
    layers: int, n_ub: int, window: int, groups: int
) -> None:
    ops = list(grouped_order(layers, n_ub, window, group_bounds(n_ub, groups)))
    flat = [divmod(i, n_ub) for i in range(layers * n_ub)]
    assert [(o.layer, o.micro_batch) for o in ops if o.kind == SEND] == flat  # both channels stay FIFO
    assert [(o.layer, o.micro_batch) for o in ops if o.kind == COLLECT] == flat
    bounds = group_bounds(n_ub, groups)
    assert [(o.micro_batch, o.count) for o in ops if o.kind == GROUP_FFN] == bounds * layers
    outstanding, collected, ffn_done = 0, set(), set()
    for o in ops:
        if o.kind == SEND:
            group = next(g for g, (first, count) in enumerate(bounds) if first <= o.micro_batch < first + count)
            assert o.layer == 0 or (o.layer - 1, group) in ffn_done  # its input is the group's FFN output
            outstanding += 1
            assert outstanding <= min(window, n_ub)
        elif o.kind == COLLECT:
            outstanding -= 1
            collected.add((o.layer, o.micro_batch))
        else:  # a group's FFN runs once all its micro-batches came back
            assert all((o.layer, m) in collected for m in range(o.micro_batch, o.micro_batch + o.count))
            ffn_done.add((o.layer, bounds.index((o.micro_batch, o.count))))
    assert outstanding == 0


def test_two_groups_ping_pong_the_host_attends_one_while_the_device_runs_the_others_experts() -> None:
    """With a full window: after group A's FFN at layer l its next layer is sent while group B's
    attention of layer l is still out, so the host attends B as the device runs A's experts."""
    ops = list(grouped_order(3, 4, 4, group_bounds(4, 2)))
    ffn_a = ops.index(next(o for o in ops if o.kind == GROUP_FFN and o.layer == 0 and o.micro_batch == 0))
    after = ops[ffn_a + 1 : ffn_a + 3]
    assert [(o.kind, o.layer, o.micro_batch) for o in after] == [(SEND, 1, 0), (SEND, 1, 1)]
    # group B's layer-0 results are still to come then
    assert [(o.kind, o.layer, o.micro_batch) for o in ops[ffn_a + 3 : ffn_a + 5]] == [(COLLECT, 0, 2), (COLLECT, 0, 3)]
    assert group_bounds(5, 2) == [(0, 3), (3, 2)]
    assert group_bounds(3, 0) == group_bounds(3, 3) == group_bounds(3, 7) == [(0, 1), (1, 1), (2, 1)]


def test_a_groups_rows_stay_within_what_the_memory_reserve_holds() -> None:
    """A group's FFN works on all its rows at once, and the device kept activations back for one
    micro-batch of --max-tokens-per-handoff: a group that would pass it is split, in order."""
    assert capped_groups([4] * 8, 2, 8192) == [(0, 4), (4, 4)]
    assert capped_groups([4] * 8, 2, 10) == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert capped_groups([4, 9000, 4, 4], 1, 8192) == [(0, 1), (1, 1), (2, 2)]  # one too big goes alone
    assert capped_groups([4] * 8, 0, 8192) is None and capped_groups([4] * 3, 2, 4) is None  # per micro-batch


def test_the_window_is_bounded_by_both_channels_and_the_micro_batches() -> None:
    assert pipeline_window(16, 4, 4) == 4
    assert pipeline_window(3, 4, 8) == 3
    assert pipeline_window(20, 8, 2) == 2
    assert pipeline_window(1, 1, 1) == 1


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> tuple[ModelSpec, torch.Tensor, ArenaLayout]:
    return arena_of(tiny_model)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(
    params=[("cpu", True), ("cpu", False), pytest.param(("cuda", True), marks=CUDA)],
    ids=["cgopipe", "overlap-off", "cuda-cgopipe"],
)
def pair(request: pytest.FixtureRequest, model: tuple) -> Iterator[ExpertRunner]:
    """A runner and an attention worker wired as the services wire them, with 2-slot channels; on CUDA
    the hand-offs go through the pinned, asynchronous path. A ring of 7 slots for the 8 experts: every
    expert streams (residency is re-planned every 2 steps)."""
    spec, arena, layout = model
    device, overlap = torch.device(request.param[0]), request.param[1]
    weights = weights_from_arena(arena, layout, spec, device, experts_on_host=True)
    run = f"pipe{os.getpid()}{device.type}{int(overlap)}"
    count = device.type == "cuda"
    with wired(
        spec, weights, device, run, 7, lookahead=overlap, residency_interval=2, overlap=overlap, count_syncs=count
    ) as p:
        yield p[0]


def _syncs() -> float:
    return REGISTRY.get_sample_value("moe_lightning_host_syncs_total", {"kind": "decode"}) or 0.0


def _plan(step: int, works: list[SequenceWork], n_ub: int, expert_groups: int = 0) -> StepPlan:
    kind = StepKind.PREFILL if works[0].sampling is not None else StepKind.DECODE  # a first step carries sampling
    return StepPlan(step, [works[m::n_ub] for m in range(n_ub)], kind, expert_groups=expert_groups)


@pytest.mark.parametrize("expert_groups", [0, 2, 5], ids=["per-micro-batch", "2-groups", "5-groups"])
def test_twelve_micro_batches_through_two_slot_channels_are_exact(
    pair: ExpertRunner, model: tuple, expert_groups: int
) -> None:
    spec, arena, layout = model
    weights = weights_from_arena(arena, layout, spec)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, spec.vocab_size, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (36,))]
    steps = 6
    want, _ = InProcessEngine(spec, weights, block_size=4).generate(
        [GenerationRequest(p, max_new_tokens=steps, ignore_eos=True) for p in prompts]
    )
    first = [SequenceWork(i, p, 0, SamplingParams()) for i, p in enumerate(prompts)]
    out = pair.step(_plan(1, first, 12, expert_groups))
    syncs_before = _syncs()
    tokens = {i: [t] for i, t in zip(out.seq_ids, out.token_ids, strict=True)}
    for step in range(2, steps + 1):
        works = [SequenceWork(i, [tokens[i][-1]], len(p) + len(tokens[i]) - 1) for i, p in enumerate(prompts)]
        out = pair.step(_plan(step, works, 12, expert_groups))
        for i, t in zip(out.seq_ids, out.token_ids, strict=True):
            tokens[i].append(t)
        assert out.timings.attention_wait > 0 and out.timings.post_attention > 0
        # cpu_attention's compute, as its replies report it: inside the step, as the service measured it
        assert 0 < out.timings.attention_busy < out.timings.step
    assert [tokens[i] for i in range(len(prompts))] == [r.token_ids for r in want]
    assert pair.link.outstanding == 0
    if pair.device.type == "cuda":  # the hand-off channels are pinned, and the host rarely waits
        assert len(pair.link._pinned) == 2
        syncs = _syncs() - syncs_before
        # the sampled tokens and a little slack: 3 rows a micro-batch run their experts without reading the
        # routing back (stages/moe.py), so nothing is read per (layer, micro-batch) (tests/test_host_syncs_step.py)
        assert syncs / (steps - 1) <= 2 * spec.num_layers + 4


def _routed_total(spec: ModelSpec) -> float:
    return sum(
        REGISTRY.get_sample_value("moe_lightning_expert_routed_tokens_total", {"layer": str(lay), "expert": str(e)})
        or 0.0
        for lay in range(spec.num_layers)
        for e in range(spec.num_experts)
    )


def test_the_routing_counter_rises_by_exactly_the_routed_tokens_past_rebalances(
    pair: ExpertRunner, model: tuple
) -> None:
    """Hot-expert residency halves its counts at every update; the exported counter must not see
    that (it once went negative on CUDA, and stopped rising on a CPU)."""
    spec = model[0]
    batch, n_ub = 10, 3
    pair.step(_plan(1, [SequenceWork(i, [5 + i, 7], 0, SamplingParams()) for i in range(batch)], n_ub))
    before = _routed_total(spec)
    tokens = {i: 0 for i in range(batch)}
    decode_steps = 2 * EXPORT_EVERY
    for step in range(decode_steps):
        out = pair.step(_plan(step + 2, [SequenceWork(i, [tokens[i]], 2 + step) for i in range(batch)], n_ub))
        tokens.update(zip(out.seq_ids, out.token_ids, strict=True))
    # the prefill's 2 tokens per sequence were not flushed yet: the first export carries them
    routed = (decode_steps + 2) * batch * spec.top_k * spec.num_sparse_layers
    assert _routed_total(spec) - before == routed
    assert int(pair.routing.hot.sum()) < routed  # while residency's counts were halved every 2 steps


def _kv_blocks_used() -> float:
    return REGISTRY.get_sample_value("moe_lightning_kv_cache_blocks", {"state": "used"}) or 0.0


def test_finished_sequences_leave_through_the_plan(pair: ExpertRunner) -> None:
    """A plan's release list reaches the attention worker ahead of the step's first hand-off, and a
    plan with nothing to run but releases frees the blocks at once (the orchestrator went idle)."""
    pair.step(_plan(1, [SequenceWork(i, [5 + i, 7, 9], 0, SamplingParams()) for i in range(4)], 2))
    assert _kv_blocks_used() == 4  # one 4-token block per sequence
    out = pair.step(StepPlan(2, [[SequenceWork(0, [3], 3)]], StepKind.DECODE, release=[1, 2]))
    assert out.seq_ids == [0] and _kv_blocks_used() == 2  # freed before the step's work
    assert set(pair.samplers) == {0, 3}
    out = pair.step(StepPlan(3, [], StepKind.DECODE, release=[0, 3]))
    assert out.seq_ids == [] and pair.samplers == {}
    deadline = time.monotonic() + 10  # no reply comes back for a release: wait for the worker
    while _kv_blocks_used() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _kv_blocks_used() == 0


def test_a_long_release_list_is_split_to_fit_the_slots() -> None:
    chunks = ReleaseHandoff.chunks(5, 9, list(range(100)), slot_bytes=64 + 8 * 30)
    assert [len(c.seq_ids) for c in chunks] == [30, 30, 30, 10]
    assert [i for c in chunks for i in c.seq_ids] == list(range(100))
    assert all(c.header.layer == RELEASE_LAYER and c.header.session == 9 for c in chunks)
    decoded = decode_expert_message(chunks[0].header.pack(), chunks[0].tensors())
    assert isinstance(decoded, ReleaseHandoff) and decoded.seq_ids == list(range(30))
