"""gpu_expert as 2 and 3 tensor-parallel ranks (gloo, on this CPU) through the real processes
(`up --gpus N`): greedy tokens and top-20 log-probabilities equal transformers' own model on
Mixtral, Qwen2-MoE (shared expert, a dense layer, one KV head replicated on every rank) and DBRX,
with the experts streamed through every rank's own buffer slots and with every expert resident;
each rank streams its own slices, whole ones (docs/parallel.md)."""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from moe_lightning.arena import ArenaLayout
from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.launcher import Stack
from moe_lightning.quant.scheme import QuantFormat, QuantScheme
from moe_lightning.shm.segment import list_segments
from moe_lightning.spec import ModelSpec

from processes import UpProcess, cli, wait_for_ranks
from quantized_reference import write_dequantized
from reference import assert_top_logprobs_match, hf_greedy, load_hf, save_hf
from test_families import PROMPTS
from tp_configs import TP_FAMILIES, rank_device_budget

STEPS = 8


@pytest.fixture(scope="module", params=list(TP_FAMILIES))
def tp_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    arch, config = TP_FAMILIES[request.param]
    model = save_hf(arch, tmp_path_factory.mktemp(request.param), seed=3, **config)
    hf = load_hf(model)
    return model, [hf_greedy(hf, p, STEPS) for p in PROMPTS]


def metrics(stack: Stack) -> str:
    with urllib.request.urlopen(stack.endpoints()["gpu_expert"]["metrics"], timeout=10) as r:
        return r.read().decode()


# two ranks streamed and resident, three streamed (a slice of every width, each rank's own slots); two
# streamed with a layer's experts once per group of micro-batches (every rank follows the same order)
@pytest.mark.parametrize(
    ("world", "experts", "groups"), [(2, "streamed", 0), (2, "resident", 0), (3, "streamed", 0), (2, "streamed", 2)]
)
def test_ranks_match_transformers(
    tp_model: tuple[Path, list], world: int, experts: str, groups: int, make_stack: Callable[..., Stack]
) -> None:
    model, reference = tp_model
    spec = ModelSpec.from_pretrained(model)
    streamed = experts == "streamed"
    budget = rank_device_budget(model, world, spec.num_experts + 1) if streamed else None  # a layer + a slice
    s = make_stack(
        model=model,
        gpus=world,
        kv_cache_memory="16MiB",
        micro_batch_size=2,
        expert_groups=groups,
        device_memory=str(budget) if budget else None,
        experts_placement="gpu",
    )
    with GenerationClient(s.api_address, timeout=120) as c:
        done = c.batch_generate(
            [Prompt(token_ids=p, max_new_tokens=STEPS, ignore_eos=True, logprobs=20) for p in PROMPTS]
        )
    text = metrics(s)
    s.stop()
    lines = (s.config.log_dir / "orchestrator.log").read_text().splitlines()
    planned = [e for e in (json.loads(x) for x in lines if x.startswith("{")) if e.get("event") == "planned"]
    assert planned and planned[0]["tensor_parallel_ranks"] == world  # the HRM plans for the ranks running
    assert planned[0]["hardware"].startswith(f"{world}x")
    assert_top_logprobs_match(done, reference, STEPS)
    per_rank = {
        int(r): float(v)
        for r, v in re.findall(r'^moe_lightning_rank_expert_bytes_streamed_total\{rank="(\d+)"\} (\S+)', text, re.M)
    }
    assert sorted(per_rank) == list(range(world))
    layout = ArenaLayout.for_spec(spec, "float32", ranks=world)
    first = spec.experts_per_layer.index(spec.num_experts)
    for rank, nbytes in per_rank.items():
        slice_bytes = layout.expert_page_bytes(first, 0, rank)
        assert slice_bytes * world < ArenaLayout.for_spec(spec, "float32").expert_page_bytes(first) * 1.1
        if streamed:  # whole slices, one transfer each, on every rank's own buffer slots
            assert nbytes > 0 and nbytes % slice_bytes == 0, (rank, nbytes, slice_bytes)
        else:
            assert nbytes == 0
    collectives = re.findall(r'^moe_lightning_rank_collective_seconds_total\{rank="(\d+)"\} (\S+)', text, re.M)
    assert len(collectives) == world and all(float(v) > 0 for _, v in collectives)


def test_up_with_two_gpus_on_this_cpu(tiny_model: Path, tmp_path: Path) -> None:
    """`moe-lightning up --gpus 2 --device cpu` as a user runs it: two ranks, text equal to the
    in-process engine's, and a clean stop that leaves no rank and no segment behind."""
    up = UpProcess(tiny_model, f"uptp{os.getpid()}", tmp_path / "logs", "--gpus", "2")
    try:
        up.read_endpoints()
        rank0 = int(up.endpoints["gpu_expert"]["pid"])
        (rank1,) = wait_for_ranks(rank0, 1)
        args = ["--prompt", "Hello there", "--max-new-tokens", "9", "--ignore-eos", "--json"]
        remote = cli("generate", "--addr", up.addr, *args)
        local = cli("generate", "--model", str(tiny_model), "--no-progress", *args)
        assert remote.returncode == 0 and local.returncode == 0, remote.stderr + local.stderr
        assert json.loads(remote.stdout)["token_ids"] == json.loads(local.stdout)["token_ids"]
    finally:
        assert up.stop(signal.SIGTERM) == 0
    assert list_segments(up.run_id) == []
    with pytest.raises(ProcessLookupError):
        os.kill(rank1, 0)


def test_ranks_a_model_cannot_be_split_over_fail_at_start_naming_the_numbers(make_stack: Callable[..., Stack]) -> None:
    from moe_lightning.launcher import StackError

    s = make_stack(gpus=3, start=False)  # the session's model: 4 heads, 2 KV heads
    with pytest.raises(StackError, match="refused before start") as info:  # by the launcher: nothing started
        s.start(timeout=120)
    assert s.procs == {}
    assert "4 attention heads do not divide by 3 ranks" in str(info.value)
    assert "2 KV heads neither divide by 3 ranks nor divide them" in str(info.value)


def test_ranks_with_int8_dense_weights_match_the_dequantized_model(
    make_stack: Callable[..., Stack], tmp_path: Path
) -> None:
    """--quantize-dense int8 on 2 ranks: each quantizes its own slice (o_proj by its columns), and the
    greedy tokens are transformers' on the checkpoint with those slices dequantized."""
    arch, config = TP_FAMILIES["mixtral"]
    model = save_hf(arch, tmp_path / "m", seed=3, **config)
    s = make_stack(model=model, gpus=2, kv_cache_memory="16MiB", quantize_dense="int8", expert_kernels="exact")
    with GenerationClient(s.api_address, timeout=120) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=STEPS, ignore_eos=True) for p in PROMPTS])
    s.stop()
    int8 = QuantScheme(QuantFormat.INT8)
    reference = load_hf(write_dequantized(model, tmp_path / "deq", None, dense=int8, ranks=2))
    assert [d.token_ids for d in done] == [hf_greedy(reference, p, STEPS)[0] for p in PROMPTS]
    one_rank = load_hf(write_dequantized(model, tmp_path / "deq1", None, dense=int8))
    assert [hf_greedy(one_rank, p, STEPS)[0] for p in PROMPTS] != [d.token_ids for d in done]  # slices show
