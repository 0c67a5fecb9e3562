"""transformers as the exactness reference, and small checkpoints made with its own classes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

FAMILIES = {  # our name -> (transformers config class, model class)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "dbrx": ("DbrxConfig", "DbrxForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}


def save_hf(family: str, out: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random-weight model of `family` built with transformers' own config and model classes and
    saved with its save_pretrained."""
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[family])
    torch.manual_seed(seed)
    model = model_cls(config_cls(**overrides)).eval()
    with torch.no_grad():  # HF initialises norms to ones; perturb them so misplaced norms show
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:  # also DBRX's norm_1 / norm_2 / norm_f
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("bias") and p.dim() == 1:  # HF initialises biases to zeros
                p.add_(0.02 * torch.randn_like(p))
            if family == "gpt_oss":
                _perturb_gpt_oss(name, p)
        for name, b in model.named_buffers():  # a sigmoid router's selection bias (zeros): large enough to
            if name.endswith("e_score_correction_bias"):  # change which experts some tokens get
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(out)
    return out


def _perturb_gpt_oss(name: str, p: torch.nn.Parameter) -> None:
    """GPT-OSS's initialisation zeroes the expert biases and keeps gate/up far inside swiglu_limit: make
    both matter, and the sinks take a real share of each softmax."""
    if name.endswith("gate_up_proj"):
        p.mul_(60)  # some gate/up values past the clamp
    elif name.endswith(("gate_up_proj_bias", "down_proj_bias")):
        p.copy_(0.5 * torch.randn_like(p))
    elif name.endswith("sinks"):
        p.copy_(torch.randn_like(p))


def save_hf_mixtral(out: Path, seed: int = 0, **overrides: Any) -> Path:
    return save_hf("mixtral", out, seed, **overrides)


def load_hf(model_dir: Path) -> Any:
    import json

    from transformers import AutoModelForCausalLM

    eager = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type") == "gpt_oss"  # no sdpa
    attn = "eager" if eager else "sdpa"
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn).eval()


@torch.no_grad()
def hf_greedy(model: Any, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the raw last-position logits of each step, by a full forward every step.

    No KV cache on the reference side: slower, but independent of transformers' cache API and of
    our own paging.
    """
    ids = list(prompt)
    tokens, logits = [], []
    for _ in range(steps):
        out = model(torch.tensor([ids])).logits[0, -1].float()
        logits.append(out)
        tokens.append(int(out.argmax()))
        ids.append(tokens[-1])
    return tokens, logits


@torch.no_grad()
def hf_generate(model: Any, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy tokens through transformers' own generate() loop (its KV cache), one prompt at a time."""
    out = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
        )
        out.append(ids[0, len(p) :].tolist())
    return out


def assert_engine_matches(
    engine: Any, prompts: list[list[int]], steps: int, reference: list[tuple[list[int], list[torch.Tensor]]]
) -> None:
    """Our in-process engine on a ragged batch against `reference` (hf_greedy per prompt): identical
    tokens, logits within 1e-4 x max(1, max|logit|) at every step."""
    from moe_lightning.request import GenerationRequest

    ours: dict[int, list[torch.Tensor]] = {}

    def keep(step: int, idx: list[int], logits: torch.Tensor) -> None:
        for i, row in zip(idx, logits, strict=True):
            ours.setdefault(i, []).append(row.clone())

    results, _ = engine.generate(
        [GenerationRequest(p, max_new_tokens=steps, ignore_eos=True) for p in prompts], on_logits=keep
    )
    for i, (ref_tokens, ref_logits) in enumerate(reference):
        assert results[i].token_ids == ref_tokens, f"prompt {i}: tokens differ"
        assert len(ours[i]) == steps
        for step, (a, b) in enumerate(zip(ours[i], ref_logits, strict=True)):
            tol = 1e-4 * max(1.0, b.abs().max().item())
            err = (a - b).abs().max().item()
            assert err <= tol, f"prompt {i} step {step}: max |logit diff| {err:.3g} > {tol:.3g}"


# The checkpoint and prompts of the end-to-end tests (made once per session in conftest.py).
E2E_CONFIG = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=6,
    num_experts_per_tok=2,
    max_position_embeddings=512,
)
E2E_PROMPTS = [
    [1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 65, 69, 73, 77, 81, 85, 89],
    [1, 300],
    [1, 4, 4, 4, 4, 4],
    [1, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89],
    [1],
    [1, 250, 251, 252],
    [1, 12, 123, 34, 45, 56, 67, 78, 89, 90, 101, 112],
    [1, 9, 8, 7, 6, 5, 4, 3],
    [1, 200, 100, 50, 25, 12, 6, 3, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
    [1, 42, 42],
]


def device_budget(model: Path, ring: int, resident_per_layer: int = 0, scheme: Any = None) -> int:
    """A gpu_expert --device-memory that holds the dense weights, `resident_per_layer` experts of every
    sparse layer and `ring` buffer slots for the rest (fp32 arena; experts in `scheme`'s format)."""
    from moe_lightning.arena import ArenaLayout
    from moe_lightning.spec import ModelSpec

    spec = ModelSpec.from_pretrained(model)
    layout = ArenaLayout.for_spec(spec, "float32", scheme)
    first = spec.experts_per_layer.index(spec.num_experts)
    expert = layout.expert_page_bytes(first)
    dense = layout.total_bytes - spec.total_experts * expert
    return dense + (spec.num_sparse_layers * resident_per_layer + ring) * expert


def assert_top_logprobs_match(
    done: list[Any], reference: list[tuple[list[int], list[torch.Tensor]]], steps: int
) -> None:
    """Completions through the stack (asked with logprobs=20) against transformers' (`hf_greedy`): the
    same greedy tokens, and the top-20 log-probabilities at every step of prefill + decode against
    log_softmax of transformers' logits, within 1e-4 x max(1, max|logit|)."""
    assert [d.token_ids for d in done] == [tokens for tokens, _ in reference]
    for i, d in enumerate(done):
        assert len(d.logprobs) == steps
        for step, (ours, ref) in enumerate(zip(d.logprobs, reference[i][1], strict=True)):
            ref_lp = torch.log_softmax(ref, dim=-1)
            tol = 1e-4 * max(1.0, ref.abs().max().item())
            got = torch.tensor(ours["top_logprobs"])
            assert ours["top_token_ids"][0] == int(ref.argmax()) and len(got) == 20
            assert (got - ref_lp[ours["top_token_ids"]]).abs().max().item() <= tol, f"prompt {i} step {step}"
            assert abs(ours["logprob"] - ref_lp[ours["token_id"]].item()) <= tol
