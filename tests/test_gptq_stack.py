"""A 4-bit GPTQ checkpoint (act order, asymmetric) through the whole stack: the weight store takes
its format from the checkpoint (`--quantize auto`), the experts stream as int4 pages, and the tokens
equal transformers' on the dequantized checkpoint; a format the checkpoint is not is refused."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.demo_model import write_demo_model
from moe_lightning.launcher import Stack, StackError
from moe_lightning.quant.gptq_config import read_gptq_config
from moe_lightning.spec import ModelSpec

from gptq_writer import write_gptq
from reference import device_budget, hf_greedy, load_hf
from test_gptq import PROMPTS, SHAPES

STEPS = 8


@pytest.fixture(scope="module")
def gptq_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    src = write_demo_model(tmp_path_factory.mktemp("src"), SHAPES, seed=6, progress=False, with_tokenizer=False)
    out = tmp_path_factory.mktemp("gptq")
    return write_gptq(src, out / "q", out / "ref", group_size=128, desc_act=True, sym=False, seed=3)


def test_a_gptq_checkpoint_streams_as_int4_pages(
    gptq_model: tuple[Path, Path], make_stack: Callable[..., Stack]
) -> None:
    q, ref = gptq_model
    spec = ModelSpec.from_pretrained(q)
    scheme = read_gptq_config(q).scheme
    s = make_stack(
        model=q,
        expert_kernels="exact",
        micro_batch_size=2,
        experts_placement="gpu",
        device_memory=str(device_budget(q, spec.num_experts + 1, 0, scheme)),
    )
    with GenerationClient(s.api_address, timeout=120) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=STEPS, ignore_eos=True) for p in PROMPTS])
    with urllib.request.urlopen(s.endpoints()["gpu_expert"]["metrics"], timeout=10) as r:
        gpu = r.read().decode()
    assert float(re.search(r"^moe_lightning_expert_bytes_streamed_total (\S+)", gpu, re.M)[1]) > 0
    hf = load_hf(ref)
    assert [d.token_ids for d in done] == [hf_greedy(hf, p, STEPS)[0] for p in PROMPTS]


def test_another_format_than_the_checkpoints_is_refused(
    gptq_model: tuple[Path, Path], make_stack: Callable[..., Stack]
) -> None:
    s = make_stack(model=gptq_model[0], quantize="int8", start=False)
    with pytest.raises(StackError, match="refused before start") as info:  # by the launcher: nothing started
        s.start(timeout=120)
    assert s.procs == {}
    assert "is a 4-bit GPTQ checkpoint" in str(info.value) and "not int8" in str(info.value)


def test_the_dequantized_pages_equal_the_reference(gptq_model: tuple[Path, Path]) -> None:
    """The arena (as the services map it) holds exactly the checkpoint's int4 values."""
    from moe_lightning.arena import ArenaLayout, fill_arena, weights_from_arena
    from moe_lightning.checkpoint import load_model_weights

    q, ref = gptq_model
    spec = ModelSpec.from_pretrained(q)
    layout = ArenaLayout.for_spec(spec, "float32", read_gptq_config(q).scheme)
    arena = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    fill_arena(arena, layout, q, spec, progress=False)
    ours = weights_from_arena(arena, layout, spec)
    want = load_model_weights(ref, spec, progress=False)
    for a, b in zip(ours.layers, want.layers, strict=True):
        for x, y in zip(a.experts, b.experts, strict=True):
            assert torch.equal(x.w13.dequantize(), y.w13) and torch.equal(x.w2.dequantize(), y.w2)
