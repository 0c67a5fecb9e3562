"""A CUDA step costs the host little (issue 53): the expert runner's decode step reads back from the
device a small constant per layer, however many micro-batches it runs. Counted on the CPU by
moe_lightning/host_syncs.py (the reads that would make a CUDA host wait), through the real runner and
attention worker over shared-memory channels, with the choice CUDA makes forced on: a micro-batch's
experts run without their routing counts read back (stages/moe.py, routes_on_device)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY
from runner_pair import arena_of, wired

from moe_lightning.arena import ArenaLayout, weights_from_arena
from moe_lightning.engine import InProcessEngine
from moe_lightning.host_syncs import count_host_syncs
from moe_lightning.placement import Side
from moe_lightning.request import GenerationRequest
from moe_lightning.sampling import SamplingParams
from moe_lightning.spec import ModelSpec
from moe_lightning.stages.moe import expert_ffn, experts_forward, routes_on_device
from moe_lightning.step_protocol import SequenceWork, StepKind, StepPlan
from moe_lightning.weights import ExpertWeights
from services.gpu_expert.runner import ExpertRunner

BATCH, DECODE_STEPS = 32, 3


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> tuple[ModelSpec, torch.Tensor, ArenaLayout]:
    return arena_of(tiny_model)


@pytest.fixture(params=[True, False], ids=["device-routing", "host-counts"])
def runner(request: pytest.FixtureRequest, model: tuple) -> Iterator[ExpertRunner]:
    """Every expert streamed through a ring (the placement where CUDA runs experts without reading
    their counts back), syncs counted."""
    spec, arena, layout = model
    device = torch.device("cpu")
    weights = weights_from_arena(arena, layout, spec, device, experts_on_host=True)
    run = f"syncs{os.getpid()}{int(request.param)}"
    ring = spec.num_experts * 3 // 2  # 1.5 layers: nothing resident, every page through the ring
    with wired(spec, weights, device, run, ring, 4, 512, count_syncs=True, routing_on_device=request.param) as pair:
        yield pair[0]


def _syncs() -> float:
    return REGISTRY.get_sample_value("moe_lightning_host_syncs_total", {"kind": "decode"}) or 0.0


def _decode(
    runner: ExpertRunner, prompts: list[list[int]], n_ub: int, first_step: int
) -> tuple[list[list[int]], float]:
    """Prefill, then DECODE_STEPS decode steps in `n_ub` micro-batches: the tokens, syncs per decode step."""
    first = [SequenceWork(i, p, 0, SamplingParams()) for i, p in enumerate(prompts)]
    out = runner.step(StepPlan(first_step, [first[m::n_ub] for m in range(n_ub)], StepKind.PREFILL))
    tokens = {i: [t] for i, t in zip(out.seq_ids, out.token_ids, strict=True)}
    before = _syncs()
    for step in range(1, DECODE_STEPS + 1):
        works = [SequenceWork(i, [tokens[i][-1]], len(p) + len(tokens[i]) - 1) for i, p in enumerate(prompts)]
        plan = StepPlan(first_step + step, [works[m::n_ub] for m in range(n_ub)], StepKind.DECODE, decodes=BATCH)
        out = runner.step(plan)
        for i, t in zip(out.seq_ids, out.token_ids, strict=True):
            tokens[i].append(t)
    runner.step(StepPlan(first_step + DECODE_STEPS + 1, [], StepKind.DECODE, release=list(range(len(prompts)))))
    return [tokens[i] for i in range(len(prompts))], (_syncs() - before) / DECODE_STEPS


def test_a_decode_steps_syncs_do_not_grow_with_its_micro_batches(runner: ExpertRunner, model: tuple) -> None:
    spec, arena, layout = model
    g = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(3, spec.vocab_size, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (BATCH,))
    ]
    want, _ = InProcessEngine(spec, weights_from_arena(arena, layout, spec), block_size=4).generate(
        [GenerationRequest(p, max_new_tokens=DECODE_STEPS + 1, ignore_eos=True) for p in prompts]
    )
    per_step = {}
    for k, n_ub in enumerate((1, 2, 4, 8)):
        assert routes_on_device(BATCH // n_ub, spec.num_experts, spec.top_k)  # every size here may skip the read
        tokens, per_step[n_ub] = _decode(runner, prompts, n_ub, 100 * k)
        assert tokens == [r.token_ids for r in want], n_ub  # exact either way
    if not runner.experts.for_step(Side.DEVICE).host_counts(BATCH // 8):  # CUDA's choice, forced here
        # the sampled tokens' read, and nothing per (layer, micro-batch)
        assert len(set(per_step.values())) == 1, per_step
        assert per_step[1] <= 2 * spec.num_layers + 4, per_step
    else:  # the host-counts path (a CPU device's): one read of the counts per (sparse layer, micro-batch)
        grows = [per_step[n] - per_step[1] for n in (2, 4, 8)]
        assert grows == [spec.num_sparse_layers * (n - 1) for n in (2, 4, 8)], per_step


def test_every_expert_on_every_row_is_the_routed_sum_and_reads_nothing_back() -> None:
    """experts_forward without host counts: the same weighted sum (fp32, expert order), the same counts,
    a non-finite output of an expert for a row it was not chosen for kept out, and no read-back."""
    g = torch.Generator().manual_seed(2)
    d, ffn, e, a, t = 32, 48, 8, 2, 24
    experts = [
        ExpertWeights(torch.randn(2 * ffn, d, generator=g) * 0.1, torch.randn(d, ffn, generator=g) * 0.1)
        for _ in range(e)
    ]
    x = torch.randn(t, d, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:a] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, a, generator=g), dim=-1)
    want, want_counts = experts_forward(x, weights, ids, experts)
    with count_host_syncs() as syncs:
        got, counts = experts_forward(x, weights, ids, experts, host_counts=False)
    assert syncs.count == 0, syncs.kinds
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert torch.equal(counts, want_counts)
    # expert 0's output is inf on every row: only the rows routed to it may see that
    broken = [ExpertWeights(torch.full_like(experts[0].w13, 1e30), experts[0].w2), *experts[1:]]
    out, _ = experts_forward(x, weights, ids, broken, host_counts=False)
    routed_to_0 = (ids == 0).any(dim=1)
    assert torch.isfinite(out[~routed_to_0]).all()
    torch.testing.assert_close(out[~routed_to_0], want[~routed_to_0], rtol=1e-6, atol=1e-7)
    assert expert_ffn(broken[0], x[:1]).isfinite().logical_not().any()


def test_routing_on_the_device_only_where_every_expert_costs_at_most_twice_the_routed_ones() -> None:
    assert routes_on_device(32, 8, 2) and routes_on_device(3, 8, 2) and not routes_on_device(2, 8, 2)
    assert not routes_on_device(16, 256, 8) and routes_on_device(32, 256, 8)  # DeepSeek-V3: from 22 rows
    assert not routes_on_device(1024, 8, 2)  # past the weight-bound rows: the counts pay for the slicing
