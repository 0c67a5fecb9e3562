"""GPT-OSS as published: experts in MXFP4 (`*_blocks`, `*_scales`, quantization_config mxfp4), loaded
into MXFP4 pages as they are and computed by our MXFP4 kernels, exact against transformers running the
same blocks and scales dequantized by its own `convert_moe_packed_tensors`; in process and through the
stack with the experts streamed; and the same checkpoint served in bf16/fp32 (dequantized) or int4
(dequantized, then quantized as any checkpoint is)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_lightning.checkpoint import load_model_weights
from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.engine import InProcessEngine
from moe_lightning.launcher import Stack
from moe_lightning.quant import kernels
from moe_lightning.quant.kernels import QuantizedLinear
from moe_lightning.quant.mxfp4 import quantize_mxfp4, to_blocks
from moe_lightning.quant.scheme import QuantFormat, QuantScheme
from moe_lightning.spec import ModelSpec

from quantized_reference import write_dequantized
from reference import assert_engine_matches, device_budget, hf_generate, hf_greedy, load_hf, save_hf
from test_families import CONFIGS, PROMPTS, STEPS

EXPERT_TENSORS = ("gate_up_proj", "down_proj")  # (E, in, out) in transformers' GPT-OSS


def to_published(src: Path, dst: Path) -> Path:
    """`src` (transformers' dequantized GPT-OSS) with its experts as the published checkpoints hold
    them: per expert, its (out, in) weight in MXFP4, blocks (E, out, in/32, 16) and scales (E, out, in/32)."""
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    for name in [n for n in sd if n.endswith(EXPERT_TENSORS)]:
        packed = [quantize_mxfp4(w.T.contiguous()) for w in sd.pop(name)]  # each (out, in)
        sd[f"{name}_blocks"] = torch.stack([to_blocks(q) for q, _ in packed])
        sd[f"{name}_scales"] = torch.stack([s for _, s in packed])
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def transformers_dequantized(published: Path, dst: Path) -> Path:
    """The published checkpoint's experts dequantized by transformers' own MXFP4 code, as an ordinary
    checkpoint transformers runs (the reference)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shutil.copytree(published, dst)
    sd = load_file(dst / "model.safetensors")
    for name in [n.removesuffix("_blocks") for n in sd if n.endswith("_blocks")]:
        blocks, scales = sd.pop(f"{name}_blocks"), sd.pop(f"{name}_scales")
        sd[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()  # (E, in, out)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    family, overrides = CONFIGS["gpt_oss_sinks_windows_yarn"]
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    dense = save_hf(family, root / "dense", seed=21, **overrides)
    published = to_published(dense, root / "published")
    return published, transformers_dequantized(published, root / "reference")


@pytest.fixture
def exact_kernels() -> Iterator[None]:
    kernels.configure("exact")  # the default may race a bf16 GEMM for fp32 activations; the reference is fp32
    yield
    kernels.configure()


def test_the_published_experts_load_as_mxfp4_pages_and_match_transformers(
    models: tuple[Path, Path], exact_kernels: None
) -> None:
    published, reference = models
    spec = ModelSpec.from_pretrained(published)
    weights = load_model_weights(published, spec, progress=False)
    w13 = weights.layers[0].experts[0].w13
    assert isinstance(w13, QuantizedLinear) and w13.format is QuantFormat.MXFP4
    assert w13.shape == (2 * spec.intermediate_size, spec.hidden_size)
    hf = load_hf(reference)
    want = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    assert_engine_matches(InProcessEngine(spec, weights, block_size=4), PROMPTS, STEPS, want)


@pytest.mark.parametrize("quantize", ["auto", "none", "int4"])
def test_the_stack_serves_the_published_checkpoint(
    quantize: str, models: tuple[Path, Path], make_stack: Callable[..., Stack], tmp_path: Path
) -> None:
    """auto: its MXFP4 pages streamed as they are; none: dequantized to the model dtype (exact: the
    reference itself); int4: dequantized, then quantized (the reference quantized alike)."""
    published, reference = models
    spec = ModelSpec.from_pretrained(published)
    scheme = {"auto": QuantScheme(QuantFormat.MXFP4), "none": None, "int4": QuantScheme(QuantFormat.INT4, 32)}[quantize]
    s = make_stack(
        model=published,
        quantize=quantize,
        quantize_group_size=32 if quantize == "int4" else None,
        expert_kernels="exact",
        micro_batch_size=2,
        kv_cache_memory="16MiB",
        device_memory=str(device_budget(published, spec.num_experts + 1, 0, scheme)),
        experts_placement="gpu",
    )
    with GenerationClient(s.api_address, timeout=120) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=10, ignore_eos=True) for p in PROMPTS])
    s.stop()
    expected = reference if scheme is None or scheme.format is QuantFormat.MXFP4 else None
    if expected is None:  # what our int4 pages make of the dequantized weights
        expected = write_dequantized(reference, tmp_path / "int4_reference", scheme)
    assert [d.token_ids for d in done] == hf_generate(load_hf(expected), PROMPTS, 10)


def test_plan_plans_gpt_oss_by_its_published_mxfp4_pages() -> None:
    """`plan --arch gpt-oss-120b --hardware t4`: its experts as published (MXFP4, 4.25 bits a weight)
    fit a 128 GB host that its bf16 weights (234 GB) do not; --quantize none says so."""
    from test_cli import without_torch

    r = without_torch("plan", "--arch", "gpt-oss-120b", "--hardware", "t4", "--host-memory", "128GB", "--json")
    assert r.returncode == 0, r.stderr
    pages = json.loads(r.stdout)["expert_pages"]
    assert pages["format"] == "mxfp4"
    assert pages["bytes_per_page"] == 3 * 2880 * 2880 * (0.5 + 1 / 32) + (2 * 2880 + 2880) * 2  # + its biases
    bf16 = without_torch(
        "plan", "--arch", "gpt-oss-120b", "--hardware", "t4", "--host-memory", "128GB", "--quantize", "none"
    )
    assert bf16.returncode != 0 and "do not fit" in bf16.stdout + bf16.stderr
