"""The families users run now (GLM-4.5 here), through the whole stack at every placement the policy
can pick and with int8 / int4 experts streamed: greedy tokens equal transformers' own model class on
the same checkpoint (on its dequantized experts for int8 / int4). The multi-token-prediction layers a
released checkpoint carries past the last decoder layer are skipped at load, and the log says so."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.launcher import Stack
from moe_lightning.quant.scheme import QuantFormat, QuantScheme
from moe_lightning.spec import ModelSpec

from quantized_reference import write_dequantized
from reference import device_budget, hf_generate, load_hf, save_hf
from test_families import CONFIGS

PROMPTS = [[1, 17, 42, 99, 7, 3, 150, 11, 5, 8, 13], [1, 190], [1, 5, 6, 7, 8, 9, 10, 66, 77], [1, 3, 3, 3]]
STEPS = 10
FAMILIES = [
    "glm4_moe_groups_qk_norm",
    "deepseek_v3_mla_yarn_groups",
    "gpt_oss_sinks_windows_yarn",
]  # each new family's richest config (test_families)
SCHEMES = {"int4": QuantScheme(QuantFormat.INT4, 32), "int8": QuantScheme(QuantFormat.INT8)}


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family, overrides = CONFIGS[request.param]
    out = save_hf(family, tmp_path_factory.mktemp(request.param), seed=7, **overrides)
    # a released checkpoint's multi-token-prediction layer: one past the decoder's last, never run
    spec = ModelSpec.from_pretrained(out)
    sd = load_file(out / "model.safetensors")
    last = spec.num_layers - 1
    extra = {
        n.replace(f"layers.{last}.", f"layers.{last + 1}."): t.clone() for n, t in sd.items() if f"layers.{last}." in n
    }
    save_file({**sd, **extra}, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def hf_tokens(family_model: Path) -> list[list[int]]:
    return hf_generate(load_hf(family_model), PROMPTS, STEPS)


def _generate(stack: Stack) -> list[list[int]]:
    with GenerationClient(stack.api_address, timeout=120) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=STEPS, ignore_eos=True) for p in PROMPTS])
    return [d.token_ids for d in done]


@pytest.mark.parametrize(("attention", "experts"), [("cpu", "gpu"), ("cpu", "cpu"), ("gpu", "gpu")])
def test_every_placement_matches_transformers(
    attention: str, experts: str, family_model: Path, hf_tokens: list[list[int]], make_stack: Callable[..., Stack]
) -> None:
    spec = ModelSpec.from_pretrained(family_model)
    s = make_stack(
        model=family_model,
        micro_batch_size=2,
        kv_cache_memory="16MiB",
        device_memory=str(device_budget(family_model, spec.num_experts + 1) + (8 << 20 if attention == "gpu" else 0)),
        device_kv_memory="8MiB" if attention == "gpu" else None,
        attention_placement=attention,
        experts_placement=experts,
    )
    tokens = _generate(s)
    s.stop()
    assert tokens == hf_tokens


def test_the_multi_token_prediction_layer_is_skipped_and_named(family_model: Path) -> None:
    from structlog.testing import capture_logs

    from moe_lightning.checkpoint import load_model_weights

    spec = ModelSpec.from_pretrained(family_model)
    with capture_logs() as logs:
        weights = load_model_weights(family_model, spec, progress=False)
    assert len(weights.layers) == spec.num_layers
    skipped = [e for e in logs if e["event"] == "checkpoint_layers_skipped"]
    assert [e["layers"] for e in skipped] == [[spec.num_layers]]


@pytest.mark.parametrize("fmt", list(SCHEMES))
def test_quantized_experts_match_the_dequantized_model(
    fmt: str, family_model: Path, make_stack: Callable[..., Stack], tmp_path: Path
) -> None:
    scheme = SCHEMES[fmt]
    spec = ModelSpec.from_pretrained(family_model)
    s = make_stack(
        model=family_model,
        quantize=fmt,
        quantize_group_size=scheme.group_size,
        expert_kernels="exact",
        micro_batch_size=2,
        kv_cache_memory="16MiB",
        device_memory=str(device_budget(family_model, spec.num_experts + 1, 0, scheme)),
        experts_placement="gpu",
    )
    tokens = _generate(s)
    s.stop()
    dequantized = write_dequantized(family_model, tmp_path / "dequantized", scheme)
    assert tokens == hf_generate(load_hf(dequantized), PROMPTS, STEPS)


def test_the_latent_cache_is_exact_under_preemption_and_long_prompts(
    make_stack: Callable[..., Stack], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """DeepSeek-V3's latent cache (one row of C + R values per token and layer) a third of what the batch
    needs: sequences are preempted and recomputed; prompts of up to 300 tokens run past YaRN's original
    context (32) and are prefilled in chunks; the tokens stay transformers'."""
    from moe_lightning.kv_format import bytes_per_token

    family, overrides = CONFIGS["deepseek_v3_mla_yarn_groups"]
    model = save_hf(
        family, tmp_path_factory.mktemp("deepseek_long"), seed=11, **{**overrides, "max_position_embeddings": 512}
    )
    spec = ModelSpec.from_pretrained(model)
    gen = torch.Generator().manual_seed(0)
    prompts = [[1, *torch.randint(2, 256, (n,), generator=gen).tolist()] for n in (300, 60, 90, 120, 75, 100, 110, 80)]
    per_token = bytes_per_token("float32", spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.kv_tensors)
    assert per_token == spec.num_layers * (spec.kv_lora_rank + spec.qk_rope_head_dim) * 4  # the latent, nothing else
    new = 40  # every sequence grows by this: the cache runs out as they do
    longest = max(len(p) for p in prompts) + new
    assert sum(len(p) + new for p in prompts) > 2.5 * longest
    s = make_stack(
        model=model,
        kv_cache_memory=per_token * (longest + 8),  # the longest request and a bit: well under a third of the batch's
        max_batch_size=64,
        prefill_budget=128,
        extra={"cpu_attention": ["--block-size", "4"]},
    )
    with GenerationClient(s.api_address, timeout=300) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=new, ignore_eos=True) for p in prompts])
    s.stop()
    assert sum(d.preemptions for d in done) > 0
    assert [d.token_ids for d in done] == hf_generate(load_hf(model), prompts, new)


def test_sliding_layers_stay_exact_past_the_window_in_chunked_prefills_and_preemption(
    make_stack: Callable[..., Stack], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """GPT-OSS with a window of 8 on every other layer: prompts of up to 200 tokens prefilled in chunks
    of 64 (a chunk's queries see the window across the chunk boundary), a cache well short of what the
    batch needs (sequences preempted and recomputed); the tokens stay transformers'."""
    from moe_lightning.kv_format import bytes_per_token

    family, overrides = CONFIGS["gpt_oss_sinks_windows_yarn"]
    model = save_hf(family, tmp_path_factory.mktemp("gpt_oss_long"), seed=13, **overrides)
    spec = ModelSpec.from_pretrained(model)
    gen = torch.Generator().manual_seed(1)
    prompts = [[1, *torch.randint(2, 256, (n,), generator=gen).tolist()] for n in (200, 40, 70, 90, 55, 80)]
    per_token = bytes_per_token("float32", spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.kv_tensors)
    new = 30
    longest = max(len(p) for p in prompts) + new
    assert sum(len(p) + new for p in prompts) > 2.5 * longest
    s = make_stack(
        model=model,
        # the sliding layers free their blocks behind the window, so the cache holds more than its
        # tokens in every layer: just over the longest request's, to keep preempting
        kv_cache_memory=per_token * (longest + 8),
        max_batch_size=64,
        prefill_budget=64,
        extra={"cpu_attention": ["--block-size", "4"]},
    )
    with GenerationClient(s.api_address, timeout=300) as c:
        done = c.batch_generate([Prompt(token_ids=p, max_new_tokens=new, ignore_eos=True) for p in prompts])
    s.stop()
    assert sum(d.preemptions for d in done) > 0
    assert [d.token_ids for d in done] == hf_generate(load_hf(model), prompts, new)
