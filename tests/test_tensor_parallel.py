"""Tensor-parallel slicing (moe_lightning/tensor_parallel.py), in one process: each rank's stages on
its slice of a model, with the ranks' partial sums added up by threads at a barrier, equal the
stages on the whole model; the arena holds each rank's slice of an expert as one range; models that
cannot be split are refused with the numbers. The same through real processes and gloo is
tests/test_tensor_parallel_e2e.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from moe_lightning.arena import ArenaLayout, fill_arena, weights_from_arena
from moe_lightning.config.checks import TensorParallelError, check_splittable
from moe_lightning.quant.scheme import QuantFormat, QuantScheme
from moe_lightning.spec import ModelSpec
from moe_lightning.stages import post_attention, pre_attention
from moe_lightning.tensor_parallel import (
    Shard,
    kv_heads,
    kv_owner,
    query_heads,
    rank_spec,
)

from reference import save_hf
from tp_configs import TP_FAMILIES


def arena_weights(model: Path, ranks: int, scheme: QuantScheme | None = None) -> list:
    spec = ModelSpec.from_pretrained(model)
    layout = ArenaLayout.for_spec(spec, "float32", scheme, ranks=ranks)
    arena = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    fill_arena(arena, layout, model, spec, progress=False)
    return [weights_from_arena(arena, layout, spec, shard=Shard(r, ranks)) for r in range(ranks)]


class BarrierSum:
    """An all-reduce among threads: each rank's partial, summed in rank order."""

    def __init__(self, world: int) -> None:
        self.parts: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world)

    def reduce(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        self.parts[rank] = t
        self.barrier.wait()
        total = torch.stack([p for p in self.parts if p is not None]).sum(0)
        self.barrier.wait()  # nobody writes the next partial before everyone summed this one
        return total


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("family", list(TP_FAMILIES))
def test_the_ranks_slices_add_up_to_the_whole_model(family: str, world: int, tmp_path: Path) -> None:
    arch, config = TP_FAMILIES[family]
    model = save_hf(arch, tmp_path / "m", seed=5, **config)
    spec = ModelSpec.from_pretrained(model)
    (whole,) = arena_weights(model, 1)
    ranks = arena_weights(model, world)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, spec.hidden_size, generator=gen)
    positions = torch.arange(7)
    hd = spec.head_dim
    for i in range(spec.num_layers):
        q, k, v = pre_attention(spec, whole.layers[i], hidden, positions)
        attn = torch.randn(7, spec.q_size, generator=gen)
        want, want_counts = post_attention(spec, whole.layers[i], hidden, attn)
        sums = BarrierSum(world)
        got: list[torch.Tensor | None] = [None] * world

        def run(r: int, layer: int, attn: torch.Tensor, sums: BarrierSum, got: list) -> None:
            shard = Shard(r, world)
            heads = query_heads(spec, shard)

            def reduce(t: torch.Tensor) -> torch.Tensor:
                return sums.reduce(r, t)

            mine = attn[:, heads.start * hd : heads.stop * hd]
            got[r], _ = post_attention(rank_spec(spec, shard), ranks[r].layers[layer], hidden, mine, reduce=reduce)

        threads = [threading.Thread(target=run, args=(r, i, attn, sums, got)) for r in range(world)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for r in range(world):
            shard = Shard(r, world)
            rq, rk, rv = pre_attention(rank_spec(spec, shard), ranks[r].layers[i], hidden, positions)
            heads, kvs = query_heads(spec, shard), kv_heads(spec, shard)
            torch.testing.assert_close(rq, q[:, heads.start : heads.stop], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(rk, k[:, kvs.start : kvs.stop], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(rv, v[:, kvs.start : kvs.stop], rtol=1e-5, atol=1e-5)
            assert all(kv_owner(spec, world, h) <= r for h in kvs)
            torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5)
        assert want_counts.sum() == 7 * spec.top_k or not spec.is_sparse(i)
    assert ranks[1].lm_head.numel() == 0 and ranks[0].lm_head.numel() > 0  # only rank 0 samples


@pytest.mark.parametrize(
    "scheme",
    [QuantScheme(QuantFormat.INT8), QuantScheme(QuantFormat.INT4, 8), QuantScheme(QuantFormat.MXFP4, 32)],
    ids=str,
)
def test_each_rank_holds_its_slice_of_a_quantized_expert_in_one_range(scheme: QuantScheme, tmp_path: Path) -> None:
    arch, config = TP_FAMILIES["mixtral"]
    if scheme.format is QuantFormat.MXFP4:  # whole blocks of 32 per rank: 64 of w2's columns each
        config = {**config, "intermediate_size": 128}
    model = save_hf(arch, tmp_path / "m", seed=5, **config)
    spec = ModelSpec.from_pretrained(model)
    (whole,) = arena_weights(model, 1, scheme)
    ranks = arena_weights(model, 2, scheme)
    inter = spec.intermediate_size
    full = whole.layers[0].experts[3]
    w13, w2 = full.w13.dequantize(), full.w2.dequantize()
    for r, part in enumerate(ranks):
        rows = list(range(r * inter // 2, (r + 1) * inter // 2))
        torch.testing.assert_close(part.layers[0].experts[3].w13.dequantize(), w13[rows + [inter + j for j in rows]])
        torch.testing.assert_close(part.layers[0].experts[3].w2.dequantize(), w2[:, rows])
        part.layers[0].experts[3].page()  # one contiguous range, or this raises
    layout = ArenaLayout.for_spec(spec, "float32", scheme, ranks=2)
    assert layout.ranks() == 2 and layout.expert_scheme() == scheme
    assert layout.expert_page_bytes(0, 0, rank=0) < ArenaLayout.for_spec(spec, "float32", scheme).expert_page_bytes(0)


def test_models_that_cannot_be_split_are_refused_with_the_numbers(tmp_path: Path) -> None:
    arch, config = TP_FAMILIES["mixtral"]
    spec = ModelSpec.from_pretrained(save_hf(arch, tmp_path / "m", **config))  # 6 heads, 6 KV heads, I 96
    check_splittable(spec, 3)
    with pytest.raises(TensorParallelError, match="6 attention heads do not divide by 4 ranks"):
        check_splittable(spec, 4)
    with pytest.raises(TensorParallelError, match="intermediate size 96 does not divide by 5"):
        check_splittable(spec, 5)
    with pytest.raises(TensorParallelError, match="act-order"):
        check_splittable(spec, 2, QuantScheme(QuantFormat.INT4, 16, act_order=True))
    with pytest.raises(TensorParallelError, match="not whole int4 groups of 32"):
        check_splittable(spec, 2, QuantScheme(QuantFormat.INT4, 32))  # 48 columns per rank
    with pytest.raises(TensorParallelError, match="not whole mxfp4 blocks of 32"):
        check_splittable(spec, 2, QuantScheme(QuantFormat.MXFP4, 32))  # 48 columns per rank
    with pytest.raises(ValueError, match="start the weight store with --tensor-parallel 2"):
        layout = ArenaLayout.for_spec(spec, "float32")
        weights_from_arena(torch.zeros(layout.total_bytes, dtype=torch.uint8), layout, spec, shard=Shard(0, 2))


def _reduce_in_a_layout(rank: int, model: str, rendezvous: str, results: dict) -> None:
    from services.gpu_expert.ranks import RankGroup

    spec = ModelSpec.from_pretrained(model)
    group = RankGroup(spec, Shard(rank, 2), torch.device("cpu"), "gloo", 60.0, Path(rendezvous), startup_timeout=60.0)
    try:
        partial = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1)
        if rank == 0:  # what the weight-major kernel hands back: the transposed view of a (4, 3)
            partial = partial.T.contiguous().T
            assert not partial.is_contiguous()
        results[rank] = group.all_reduce(partial).tolist()
    finally:
        group.close()


def test_an_all_reduce_of_partials_in_different_layouts_is_their_sum(tmp_path: Path) -> None:
    """Each rank races its dense kernels on its own, so one rank's o_proj partial may be a
    transposed view while another's is row-major (a CI failure once: the ranks' greedy tokens were
    another sequence's); through real processes and gloo, the reduce is the sum of the values."""
    import multiprocessing

    arch, config = TP_FAMILIES["mixtral"]
    model = save_hf(arch, tmp_path / "m", **config)
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        procs = [
            context.Process(target=_reduce_in_a_layout, args=(r, str(model), str(tmp_path / "rdv"), results))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0, 0]
        want = (torch.arange(12, dtype=torch.float32).reshape(3, 4) * 3).tolist()
        assert results[0] == want and results[1] == want
