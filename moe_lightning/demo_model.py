"""Built-in demo checkpoints: HF-format Mixtral models with random weights, deterministic by seed.

They need no download, load in transformers as they are, and come with a real byte-level BPE
tokenizer trained on a generated corpus, so text in and text out work end to end.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm

from moe_lightning.spec import ModelSpec
from moe_lightning.torch_dtypes import DTYPES

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 as in Mixtral

# ChatML's layout, with the checkpoint's own BOS first (the template writes it, so prompts are
# tokenized without special tokens, as in transformers) and EOS closing each turn: generation stops
# at EOS, so a reply ends exactly where the template ends a turn. The markers are plain text to the
# demo tokenizer, which keeps its vocabulary, and so every demo checkpoint's token ids, unchanged.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PRESETS: dict[str, dict[str, Any]] = {
    # a few MB: unit and end-to-end tests
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=512,
        max_position_embeddings=1024,
    ),
    # ~0.8 B parameters, ~3.2 GB in fp32: benchmarks on a 2-core machine
    "bench": dict(
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    # Mixtral 8x7B's shapes with 4 of its 32 layers, ~6.1 B parameters, ~12 GB in bf16: the GPU check
    # (bench/gpu_check.py); build it on the GPU (`device="cuda"`), on a CPU it takes minutes
    "mixtral-8x7b-4l": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        max_position_embeddings=32768,
    ),
}


def mixtral_config(preset: str | dict[str, Any], dtype: str = "float32") -> dict[str, Any]:
    """An HF config.json dict for a preset name or a dict of overrides."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        preset = PRESETS[preset]
    config: dict[str, Any] = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "sliding_window": None,
        "initializer_range": 0.02,
        "dtype": dtype,
    }
    config.update(preset)
    return config


ARCHS = ("mixtral", "olmoe", "qwen2-moe", "qwen3-moe", "dbrx")


def demo_config(preset: str | dict[str, Any], arch: str = "mixtral", dtype: str = "float32") -> dict[str, Any]:
    """config.json of `arch` with a preset's shapes (presets are written in Mixtral's field names)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    config = mixtral_config(preset, dtype)
    if arch == "mixtral":
        return config
    experts = config.pop("num_local_experts")
    config.pop("sliding_window", None)
    if arch == "dbrx":
        theta = 500_000.0
        return {
            "architectures": ["DbrxForCausalLM"],
            "model_type": "dbrx",
            "d_model": config["hidden_size"],
            "n_heads": config["num_attention_heads"],
            "n_layers": config["num_hidden_layers"],
            "max_seq_len": config["max_position_embeddings"],
            "vocab_size": config["vocab_size"],
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "dtype": dtype,
            # both spellings, equal: transformers 5 reads rope_parameters, released configs attn_config
            "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "attn_config": {"kv_n_heads": config["num_key_value_heads"], "clip_qkv": 8.0, "rope_theta": theta},
            "ffn_config": {
                "ffn_hidden_size": config["intermediate_size"],
                "moe_num_experts": experts,
                "moe_top_k": config["num_experts_per_tok"],
                "moe_normalize_expert_weights": 1.0,
                "ffn_act_fn": {"name": "silu"},
            },
        }
    if arch == "olmoe":
        config.update(
            architectures=["OlmoeForCausalLM"],
            model_type="olmoe",
            num_experts=experts,
            norm_topk_prob=False,
            clip_qkv=None,
            rope_theta=10_000.0,
        )
    elif arch == "qwen2-moe":
        config.update(
            architectures=["Qwen2MoeForCausalLM"],
            model_type="qwen2_moe",
            num_experts=experts,
            moe_intermediate_size=config["intermediate_size"],
            shared_expert_intermediate_size=2 * config["intermediate_size"],
            intermediate_size=4 * config["hidden_size"],  # the dense layers' MLP width
            qkv_bias=True,
            norm_topk_prob=False,
            # a preset may make some layers dense; by default every layer is sparse
            decoder_sparse_step=config.get("decoder_sparse_step", 1),
            mlp_only_layers=config.get("mlp_only_layers", []),
            rms_norm_eps=1e-6,
            use_sliding_window=False,
        )
    else:
        config.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            num_experts=experts,
            moe_intermediate_size=config["intermediate_size"],
            intermediate_size=4 * config["hidden_size"],  # the dense layers' MLP width
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            norm_topk_prob=True,
            decoder_sparse_step=config.get("decoder_sparse_step", 1),
            mlp_only_layers=config.get("mlp_only_layers", []),
            rms_norm_eps=1e-6,
            use_sliding_window=False,
        )
    return config


def _random_state_dict(
    spec: ModelSpec, seed: int, dtype: torch.dtype, progress: bool, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Seeded random weights, generated on `device` (a GPU makes billions of them in a second; the
    values then differ from the CPU's for the same seed, but are as deterministic)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    d, inter = spec.hidden_size, spec.intermediate_size

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).mul_(0.02).to(dtype)  # in place: one 3 GB pass less

    def norm_weight(size: int = d) -> torch.Tensor:
        # not all ones, so a test notices a norm weight that is dropped or misplaced
        return (1.0 + 0.1 * torch.randn(size, generator=gen, device=device)).to(dtype)

    if spec.architecture == "DbrxForCausalLM":
        return _random_dbrx_state_dict(spec, normal, norm_weight, progress)
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(spec.vocab_size, d)}
    for i in tqdm(range(spec.num_layers), desc="generating layers", unit="layer", disable=not progress, leave=False):
        p = f"model.layers.{i}"
        sd[f"{p}.input_layernorm.weight"] = norm_weight()
        sd[f"{p}.self_attn.q_proj.weight"] = normal(spec.q_size, d)
        sd[f"{p}.self_attn.k_proj.weight"] = normal(spec.kv_size, d)
        sd[f"{p}.self_attn.v_proj.weight"] = normal(spec.kv_size, d)
        sd[f"{p}.self_attn.o_proj.weight"] = normal(d, spec.q_size)
        sd[f"{p}.post_attention_layernorm.weight"] = norm_weight()
        if spec.qk_norm is not None:
            q_size, k_size = spec.qk_norm_shapes()
            sd[f"{p}.self_attn.q_norm.weight"] = norm_weight(q_size)
            sd[f"{p}.self_attn.k_norm.weight"] = norm_weight(k_size)
        if spec.qkv_bias:
            for proj, size in (("q_proj", spec.q_size), ("k_proj", spec.kv_size), ("v_proj", spec.kv_size)):
                sd[f"{p}.self_attn.{proj}.bias"] = normal(size)
        if not spec.is_sparse(i):  # a dense layer: one MLP
            for name, shape in _mlp_shapes(d, spec.dense_intermediate_size):
                sd[f"{p}.mlp.{name}.weight"] = normal(*shape)
            continue
        if spec.shared_expert_size:
            for name, shape in _mlp_shapes(d, spec.shared_expert_size):
                sd[f"{p}.mlp.shared_expert.{name}.weight"] = normal(*shape)
            sd[f"{p}.mlp.shared_expert_gate.weight"] = normal(1, d)
        mixtral = spec.architecture == "MixtralForCausalLM"
        moe = f"{p}.block_sparse_moe" if mixtral else f"{p}.mlp"
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        sd[f"{moe}.gate.weight"] = normal(spec.num_experts, d)
        for e in range(spec.num_experts):
            q = f"{moe}.experts.{e}"
            sd[f"{q}.{names[0]}.weight"] = normal(inter, d)
            sd[f"{q}.{names[1]}.weight"] = normal(inter, d)
            sd[f"{q}.{names[2]}.weight"] = normal(d, inter)
    sd["model.norm.weight"] = norm_weight()
    if not spec.tie_word_embeddings:
        sd["lm_head.weight"] = normal(spec.vocab_size, d)
    return sd


def _mlp_shapes(d: int, inter: int) -> tuple[tuple[str, tuple[int, int]], ...]:
    return ("gate_proj", (inter, d)), ("up_proj", (inter, d)), ("down_proj", (d, inter))


def _random_dbrx_state_dict(
    spec: ModelSpec, normal: Callable[..., torch.Tensor], norm_weight: Callable[[], torch.Tensor], progress: bool
) -> dict[str, torch.Tensor]:
    """DBRX's names and layout: fused Wqkv, every expert of a layer in (E * I, D) blocks."""
    d, inter, e = spec.hidden_size, spec.intermediate_size, spec.num_experts
    sd: dict[str, torch.Tensor] = {"transformer.wte.weight": normal(spec.vocab_size, d)}
    for i in tqdm(range(spec.num_layers), desc="generating layers", unit="layer", disable=not progress, leave=False):
        p = f"transformer.blocks.{i}"
        a = f"{p}.norm_attn_norm"
        sd[f"{a}.norm_1.weight"] = norm_weight()
        sd[f"{a}.attn.Wqkv.weight"] = normal(spec.q_size + 2 * spec.kv_size, d)
        sd[f"{a}.attn.out_proj.weight"] = normal(d, spec.q_size)
        sd[f"{a}.norm_2.weight"] = norm_weight()
        sd[f"{p}.ffn.router.layer.weight"] = normal(e, d)
        for w in ("w1", "v1", "w2"):
            sd[f"{p}.ffn.experts.mlp.{w}"] = normal(e * inter, d)
    sd["transformer.norm_f.weight"] = norm_weight()
    sd["lm_head.weight"] = normal(spec.vocab_size, d)
    return sd


_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ar", "en", "is", "on")]


def _corpus(seed: int, n_words: int) -> list[str]:
    # A deterministic pseudo-language with Zipf-like word frequencies, so BPE learns real merges.
    rng = random.Random(seed)
    lexicon = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(20000)]
    weights = [1.0 / (r + 1) for r in range(len(lexicon))]
    words = rng.choices(lexicon, weights=weights, k=n_words)
    lines, line = [], []
    for w in words:
        line.append(w)
        if len(line) >= rng.randint(6, 14):
            lines.append(" ".join(line).capitalize() + rng.choice([".", "?", "!", ","]))
            line = []
    return lines


def build_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    """A byte-level BPE whose vocabulary is exactly `vocab_size` (padded with reserved tokens)."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed, n_words=min(400_000, 40 * vocab_size)), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_special_tokens([f"<reserved_{i}>" for i in range(missing)])
    bos = SPECIAL_TOKENS[1]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    return tok


def write_demo_model(
    out_dir: str | Path,
    preset: str | dict[str, Any] = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    progress: bool = True,
    with_tokenizer: bool = True,
    device: str = "cpu",
    arch: str = "mixtral",
) -> Path:
    """Writes config.json, model.safetensors, tokenizer.json and generation_config.json of `arch`
    (one of ARCHS) with the preset's shapes.

    `device`: where the random weights are generated (see `_random_state_dict`); they are saved from
    host memory either way."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = demo_config(preset, arch, dtype)
    spec = ModelSpec.from_hf_config(config)
    sd = _random_state_dict(spec, seed, DTYPES[dtype], progress, device)
    if torch.device(device).type != "cpu":
        sd = {name: t.cpu() for name, t in sd.items()}  # safetensors serializes host memory
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    del sd
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if with_tokenizer:
        tok = build_tokenizer(spec.vocab_size, seed)
        tok.save(str(out / "tokenizer.json"))
        tok_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "model_max_length": spec.max_position_embeddings,
            "chat_template": CHAT_TEMPLATE,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return out
